// ferroattn — profiler stamp marks (experimental, src/profiler.rs "stamps").
//
// What: profiler_stamp writes the GPU's global timer (%globaltimer: nanoseconds, a 64-bit
// counter shared by every SM of the device) into one 64-bit slot of a device buffer. Launched
// as a 1 x 1 grid on the caller's stream, it runs in stream order between the work before and
// after it, so a slot holds "when the GPU got to this point of the stream" (the stamp kernel's
// own launch latency included). An alternative to recording a CUDA event per mark: a kernel
// launch instead of cuEventRecord on the host.
// profiler_globaltimer_probe: one thread reads %globaltimer `iters` times in a loop and writes
// out[0] = smallest non-zero difference between consecutive reads (ns; 0 if it never changed),
// out[1] = how many reads differed from the one before, out[2] = last - first read (ns),
// out[3] = largest difference (ns): the timer's update granularity as this GPU runs it.
// Constraints: launch with one thread (grid 1, block 1); `slot` / `out` are 8-byte aligned
// device pointers (out: 4 slots).
// PTX features: %globaltimer (sm_30+; its update interval is the device's: about 1 us on many
// GPUs unless a profiling tool raises it, which the probe measures).
#pragma once

namespace ferroattn {

__device__ __forceinline__ unsigned long long globaltimer_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void profiler_stamp(unsigned long long* slot) {
    *slot = globaltimer_ns();
}

__global__ void profiler_globaltimer_probe(unsigned long long* out, int iters) {
    unsigned long long first = globaltimer_ns();
    unsigned long long prev = first;
    unsigned long long min_delta = 0, max_delta = 0, changes = 0;
    for (int i = 0; i < iters; ++i) {
        const unsigned long long t = globaltimer_ns();
        const unsigned long long d = t - prev;
        if (d != 0) {
            ++changes;
            if (min_delta == 0 || d < min_delta) min_delta = d;
            if (d > max_delta) max_delta = d;
        }
        prev = t;
    }
    out[0] = min_delta;
    out[1] = changes;
    out[2] = prev - first;
    out[3] = max_delta;
}

}  // namespace ferroattn
