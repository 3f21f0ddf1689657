#!/usr/bin/env python3
"""Writes kernels/common/wgmma.cuh: inline-PTX wrappers of wgmma.mma_async m64nNk16 (fp32
accumulators, f16/bf16 inputs) for the N the GEMM and attention kernels use, in two forms:
  SS: A and B from shared-memory descriptors (PTX ISA "wgmma.mma_async", a-desc, b-desc);
  RS: A from four 32-bit registers per thread (the m64k16 register fragment), B from a descriptor.
The operand lists (N / 2 accumulators per thread) are too long to write by hand.
Run: python scripts/gen_wgmma.py > kernels/common/wgmma.cuh
"""

SS_N = (64, 80, 96, 128, 176, 192, 256)
RS_N = (64, 96, 128, 192, 256)
TYPES = (("bf16", "bf16"), ("f16", "f16"))


def operand_rows(regs: int) -> str:
    rows = []
    for r0 in range(0, regs, 16):
        row = ", ".join(f"%{i}" for i in range(r0, min(r0 + 16, regs)))
        rows.append(row)
    return ",\" \\\n        \"".join(rows)


def outputs(regs: int) -> str:
    items = [f'"+f"(d[{i}])' for i in range(regs)]
    lines = [", ".join(items[i:i + 8]) for i in range(0, regs, 8)]
    return ", \\\n          ".join(lines)


def ss(n: int) -> str:
    r = n // 2
    return f"""#define FERROATTN_WGMMA_M64N{n}K16(NAME, TY) \\
template <int TransA, int TransB> \\
__device__ __forceinline__ void NAME(float (&d)[{r}], unsigned long long desc_a, \\
                                                   unsigned long long desc_b, int scale_d) {{ \\
    asm volatile( \\
        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{r + 2}, 0;\\n" \\
        "wgmma.mma_async.sync.aligned.m64n{n}k16.f32." TY "." TY " " \\
        "{{" \\
        "{operand_rows(r)}" \\
        "}}, %{r}, %{r + 1}, p, 1, 1, %{r + 3}, %{r + 4};\\n}}\\n" \\
        : {outputs(r)} \\
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TransA), "n"(TransB)); \\
}}
""" + "".join(f"FERROATTN_WGMMA_M64N{n}K16(wgmma_m64n{n}k16_{name}, \"{ty}\")\n" for name, ty in TYPES) + \
        f"#undef FERROATTN_WGMMA_M64N{n}K16\n"


def rs(n: int) -> str:
    r = n // 2
    return f"""#define FERROATTN_WGMMA_M64N{n}K16_RS(NAME, TY) \\
template <int TransB> \\
__device__ __forceinline__ void NAME(float (&d)[{r}], const unsigned (&a)[4], \\
                                     unsigned long long desc_b, int scale_d) {{ \\
    asm volatile( \\
        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{r + 5}, 0;\\n" \\
        "wgmma.mma_async.sync.aligned.m64n{n}k16.f32." TY "." TY " " \\
        "{{" \\
        "{operand_rows(r)}" \\
        "}}, {{%{r}, %{r + 1}, %{r + 2}, %{r + 3}}}, %{r + 4}, p, 1, 1, %{r + 6};\\n}}\\n" \\
        : {outputs(r)} \\
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TransB)); \\
}}
""" + "".join(f"FERROATTN_WGMMA_M64N{n}K16_RS(wgmma_m64n{n}k16_rs_{name}, \"{ty}\")\n" for name, ty in TYPES) + \
        f"#undef FERROATTN_WGMMA_M64N{n}K16_RS\n"


def dispatch() -> str:
    def chain(ns, call):
        parts = []
        for i, n in enumerate(ns):
            kw = "if constexpr" if i == 0 else "} else if constexpr"
            parts.append(f"    {kw} (N == {n}) {{\n"
                         f"        if constexpr (DTypeTraits<T>::kIsBF16) {call(n, 'bf16')};\n"
                         f"        else {call(n, 'f16')};\n")
        parts.append("    }\n")
        return "".join(parts)
    ss_list = ", ".join(map(str, SS_N))
    rs_list = ", ".join(map(str, RS_N))
    return (
        "// d (64 x N, fp32) (+)= A (64 x 16) * B (16 x N) for T = __half / __nv_bfloat16, A and B from\n"
        "// shared-memory descriptors; scale_d = 0 overwrites d. TransA / TransB = 1: that operand is\n"
        f"// MN-major in shared memory. N in {{{ss_list}}}.\n"
        "template <typename T, int N, int TransA, int TransB>\n"
        "__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], unsigned long long desc_a,\n"
        "                                         unsigned long long desc_b, int scale_d) {\n"
        f"    static_assert({' || '.join(f'N == {n}' for n in SS_N)}, \"no wgmma_ss wrapper for this N\");\n"
        + chain(SS_N, lambda n, t: f"wgmma_m64n{n}k16_{t}<TransA, TransB>(d, desc_a, desc_b, scale_d)")
        + "}\n\n"
        "// As wgmma_ss with A from registers: a[0..3] hold this thread's m64k16 fragment (warp w of the\n"
        "// warpgroup owns rows 16w .. 16w + 15; lane l: a[0] = (row l/4, cols 2(l%4), +1), a[1] = the\n"
        "// same columns of row l/4 + 8, a[2] / a[3] = columns 8 + 2(l%4), +1 of those rows; the low half\n"
        f"// is the lower column). N in {{{rs_list}}}.\n"
        "template <typename T, int N, int TransB>\n"
        "__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const unsigned (&a)[4],\n"
        "                                         unsigned long long desc_b, int scale_d) {\n"
        f"    static_assert({' || '.join(f'N == {n}' for n in RS_N)}, \"no wgmma_rs wrapper for this N\");\n"
        + chain(RS_N, lambda n, t: f"wgmma_m64n{n}k16_rs_{t}<TransB>(d, a, desc_b, scale_d)")
        + "}\n"
    )


def main() -> None:
    print("// ferroattn — wgmma.mma_async wrappers (sm_90a), generated by scripts/gen_wgmma.py: do not edit.")
    print("//")
    print("// Accumulator layout of m64nNk16 (PTX ISA \"Matrix fragments for wgmma .m64nNk16\"): thread t")
    print("// of the warpgroup, warp w = t/32, lane l: d[4j + 2h + e] is row 16w + l/4 + 8h, column")
    print("// 8j + 2(l%4) + e. The RS form's A fragment (PTX ISA \"Register fragment layout for matrix A\")")
    print("// is that layout packed to 16 bits, so an S accumulator converts to P in place (wgmma_rs).")
    print("#pragma once")
    print('#include "common/dtype.cuh"')
    print()
    print("namespace ferroattn {")
    print("namespace sm90 {")
    print()
    for n in SS_N:
        print(ss(n))
    for n in RS_N:
        print(rs(n))
    print(dispatch())
    print("}  // namespace sm90")
    print("}  // namespace ferroattn")


if __name__ == "__main__":
    main()
