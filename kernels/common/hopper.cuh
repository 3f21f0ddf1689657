// ferroattn — Hopper (sm_90a) primitives shared by every sm90 kernel family (GEMM, 2:4, attention):
// the TMA tensor-map parameter type, mbarrier waits and arrivals, TMA bulk tensor loads / stores,
// named barriers, wgmma shared-memory descriptors, fences and groups. The wgmma instructions
// themselves are in common/wgmma.cuh (generated).
// PTX features (sm_90a): mbarrier.init / arrive(.expect_tx) / try_wait.parity, cp.async.bulk.tensor
// (load with complete_tx, store with bulk groups), prefetch.tensormap, fence.proxy.async.shared::cta,
// bar.sync with a thread count, wgmma.fence / commit_group / wait_group.
#pragma once
#include "common/dtype.cuh"
#include "common/wgmma.cuh"

namespace ferroattn {

// A CUtensorMap (cuda.h, CUDA 13: 128 opaque bytes, 128-byte aligned) as a kernel parameter.
struct alignas(128) TmaMap {
    unsigned long long opaque[16];
};

namespace sm90 {

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// ---- mbarrier ---------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                 :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
// Suspend-time hint of every mbarrier wait, in ns (PTX ISA "mbarrier.test_wait/try_wait": a
// suspended thread resumes when the phase completes, or at the latest after this limit; without a
// hint the limit is system-dependent and short: ncu counted 5 M try_wait retries of the ping-pong
// producer in one 8192 x 4096 x 4096 launch, ~10 ns per retry).
constexpr unsigned kWaitHintNs = 1000000u;

// The body of an mbarrier wait: try_wait.parity (with the suspend-time hint) on `bar` until the
// phase of parity `parity` has completed. SEM: "" (default .acquire.cta) or ".acquire.cluster".
// A macro, not a helper function: mbar_wait's code stays token for token what gemm_sm90's
// validated SASS was compiled from.
#define FERROATTN_MBAR_WAIT_LOOP(SEM, bar, parity)                                                 \
    unsigned done;                                                                                \
    do {                                                                                          \
        asm volatile(                                                                             \
            "{\n.reg .pred p;\n"                                                                  \
            "mbarrier.try_wait.parity" SEM ".shared::cta.b64 p, [%1], %2, %3;\n"                  \
            "selp.u32 %0, 1, 0, p;\n}\n"                                                          \
            : "=r"(done) : "r"(bar), "r"(parity), "n"(kWaitHintNs) : "memory");                   \
    } while (!done)

// Wait until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    FERROATTN_MBAR_WAIT_LOOP("", bar, parity);
}

// ---- TMA --------------------------------------------------------------------------------
__device__ __forceinline__ void tma_load_3d(unsigned dst, const TmaMap* map, unsigned bar,
                                            int c0, int c1, int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4}], [%5];\n"
        :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2),
           "r"(bar)
        : "memory");
}
__device__ __forceinline__ void tma_prefetch_map(const TmaMap* map) {
    asm volatile("prefetch.tensormap [%0];\n"
                 :: "l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}

// Bulk tensor store shared -> global (the box at coordinates (c0, c1, c2); out-of-range parts
// of the box are not written), tracked by this thread's bulk async-groups.
__device__ __forceinline__ void tma_store_3d(const TmaMap* map, unsigned src, int c0, int c1, int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n"
        :: "l"(reinterpret_cast<unsigned long long>(map)), "r"(src), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
}
// 4-d forms (attention: (head dim, rows, heads, batch) maps).
__device__ __forceinline__ void tma_load_4d(unsigned dst, const TmaMap* map, unsigned bar,
                                            int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
        :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2),
           "r"(c3), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void tma_store_4d(const TmaMap* map, unsigned src, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
        :: "l"(reinterpret_cast<unsigned long long>(map)), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}

// Register budget of the calling warpgroup (setmaxnreg; every thread of the warpgroup executes it;
// N a multiple of 8 in 24..256).
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(N));
}

__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Wait until at most N of this thread's bulk groups still read their shared-memory source.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(N) : "memory");
}
// Wait until every bulk group of this thread has completed (writes visible).
__device__ __forceinline__ void bulk_wait_all() {
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
// Generic-proxy shared-memory writes -> visible to the async proxy (TMA store reads).
__device__ __forceinline__ void fence_proxy_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Barrier `id` (1..15) over `count` threads (one warpgroup here).
__device__ __forceinline__ void named_barrier(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(count) : "memory");
}
// Arrive at barrier `id` without waiting (the other side of a named_barrier over `count` threads).
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void st_shared_b32(unsigned addr, unsigned v) {
    asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(addr), "r"(v));
}
__device__ __forceinline__ void st_shared_v2_f32(unsigned addr, float a, float b) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" :: "r"(addr), "f"(a), "f"(b));
}

// ---- wgmma ------------------------------------------------------------------------------
// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading / stride byte
// offsets (all >> 4, 14 bits each), swizzle mode 1 in bits 62-63; base offset 0 (every
// swizzle atom starts 1024-byte aligned).
__device__ __forceinline__ unsigned long long wgmma_desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return static_cast<unsigned long long>((addr & 0x3FFFF) >> 4)
         | (static_cast<unsigned long long>((lbo & 0x3FFFF) >> 4) << 16)
         | (static_cast<unsigned long long>((sbo & 0x3FFFF) >> 4) << 32)
         | (1ull << 62);
}
// A descriptor is built once per kernel (wgmma_desc, masking the address to its 18-bit window
// offset) and then advanced by adding bytes / 16 to its low 32-bit word (desc_at). Exact: every
// address the kernels describe is a window offset below 227 KiB + 1 KiB < 2^18, so its >> 4 fits
// the 14-bit start-address field (bits 0-13) and a sum that is itself such an address never
// carries into bit 14 (bits 14-15 are reserved zero; LBO starts at bit 16). Only the low word
// changes, so the high word (SBO, swizzle) stays one constant and the adds are 32-bit: ptxas keeps
// the descriptors in uniform registers when their inputs are warp-uniform (SASS: UIADD3 feeding
// HGMMA's gdesc[UR], no R2UR per wgmma).
// `bytes` is a signed multiple of 16 (a step back to stage 0 is negative: bytes / 16 is then exact
// and the 32-bit sum wraps to the right field value; an unsigned (2^32 - x) >> 4 would not).
__device__ __forceinline__ unsigned long long desc_at(unsigned long long desc, int bytes) {
    const unsigned lo = static_cast<unsigned>(desc) + static_cast<unsigned>(bytes / 16);
    return (desc & 0xFFFFFFFF00000000ull) | lo;
}

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}
template <int Regs>
__device__ __forceinline__ void fence_accumulators(float (&d)[Regs]) {
#pragma unroll
    for (int i = 0; i < Regs; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
// The same for a register-A operand (wgmma RS): its definitions stay before the next wgmma_fence.
template <int K>
__device__ __forceinline__ void fence_fragments(unsigned (&a)[K][4]) {
#pragma unroll
    for (int i = 0; i < K; ++i)
#pragma unroll
        for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(a[i][r]) :: "memory");
}

}  // namespace sm90
}  // namespace ferroattn
