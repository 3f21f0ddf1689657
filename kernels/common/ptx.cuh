// ferroattn — inline-PTX wrappers for the sm80-family tensor-core path.
//
// What: mma.sync m16n8k16 (row.col, fp32 accumulate, f16 or bf16 operands), ldmatrix x4 and
// x4.trans, cp.async 16-byte .cg copies with a zero-fill predicate (src-size 0 writes 16 zero
// bytes and reads nothing), commit/wait_group, and a fast exp2.
// Fragment layouts (PTX ISA "Matrix fragments for mma.m16n8k16"), g = lane/4, t = lane%4:
//   A 16x16 (4 regs): a0 (g, 2t..2t+1) a1 (g+8, 2t..) a2 (g, 2t+8..) a3 (g+8, 2t+8..)
//   B 16x8  (2 regs): b0 (k=2t..2t+1, n=g) b1 (k=2t+8.., n=g)
//   C 16x8  (4 f32):  c0,c1 (g, 2t..2t+1) c2,c3 (g+8, 2t..2t+1)
// Constraints: shared-memory addresses are 32-bit .shared window addresses (smem_u32);
// cp.async sources must be 16-byte aligned global addresses even when predicated off
// (pass any valid aligned pointer then).
// PTX features: mma.sync.aligned.m16n8k16 (.f16 sm_80+, .bf16 sm_80+), ldmatrix (sm_75+),
// cp.async.cg with src-size (sm_80+), ex2.approx.ftz.f32.
#pragma once
#include "common/dtype.cuh"

namespace ferroattn {

// +inf as a float constant (NVRTC does not guarantee the INFINITY macro).
#define FERROATTN_INF (__int_as_float(0x7f800000))

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// d += a * b, fp32 accumulators, operands of type T (half or bf16).
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4],
                                             unsigned b0, unsigned b1) {
    if constexpr (DTypeTraits<T>::kIsBF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, r[i] receives it.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// 16-byte global->shared async copy bypassing L1; when !pred, writes 16 zero bytes and
// reads nothing from src (src must still be a valid address expression).
__device__ __forceinline__ void cp_async_16_zfill(unsigned smem_addr, const void* src, bool pred) {
    const int src_size = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr), "l"(src), "r"(src_size) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Wait until at most N of this thread's committed groups are still pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

// Defines `__device__ TYPE NAME()` returning special register `%REG` (a string literal, e.g.
// "ctaid.x") through volatile asm (PTX ISA "Special registers"; TYPE is a 32-bit int type).
#define FERROATTN_SREG_READER(NAME, TYPE, REG)                          \
    __device__ __forceinline__ TYPE NAME() {                            \
        TYPE v;                                                          \
        asm volatile("mov.u32 %0, %%" REG ";\n" : "=r"(v));            \
        return v;                                                        \
    }

// Launch indices read through volatile asm: the compiler must re-read them where they are
// used instead of keeping values derived from them live (the attention kernel's lean K/V
// loads re-read %tid.x this way; the %ctaid readers are kept for the same purpose).
FERROATTN_SREG_READER(ctaid_x_volatile, int, "ctaid.x")
FERROATTN_SREG_READER(ctaid_y_volatile, int, "ctaid.y")
FERROATTN_SREG_READER(ctaid_z_volatile, int, "ctaid.z")
FERROATTN_SREG_READER(tid_x_volatile, int, "tid.x")

// 64-bit load from a .shared window address, volatile: re-executed where it is written, so
// ptxas cannot hoist it and keep the value live in registers instead.
__device__ __forceinline__ unsigned long long ld_shared_u64_volatile(unsigned addr) {
    unsigned long long v;
    asm volatile("ld.volatile.shared.u64 %0, [%1];\n" : "=l"(v) : "r"(addr) : "memory");
    return v;
}

// 2^x, approximate (max rel. error ~2^-22), flushes denormals; ex2(-inf) = +0.
__device__ __forceinline__ float exp2_fast(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

}  // namespace ferroattn
