// Remote-store burst microbenchmark for the X-Stage calibration (DESIGN §2).
//
// K producers (one CTA per SM) each write `bytes_per_producer` bytes with 16-byte stores to a target
// buffer (local HBM, host-pinned mapped memory over PCIe, or a peer GPU's buffer through its mapped
// address), then do `gap_iters` iterations of useful arithmetic (a fixed amount of work, not a time:
// a stall that lands in the gap lengthens the period instead of eating the work), `num_bursts` times. Per producer and burst the
// issue start/end are taken with clock64() (the SM clock; %globaltimer only ticks in 256 ns steps,
// so it is used to align the producers' start and to convert cycles to seconds).
//
// With `align_every_burst` every burst starts aligned (a grid barrier after each producer's gap), which
// is the setting of the X-Stage laws: a burst is V = K * B bytes issued together. Without it only the first
// burst is aligned and the producers free-run: one backed-up burst staggers their finish times, the later
// bursts start staggered, their aggregate never reaches V at once and the long-gap issue time stops
// describing a burst of V (calibration run 3 on the H200: host-pinned, 8.65 MB, long gap 1.27 us vs 85 us
// for the same burst issued aligned).
//
// Plain C ABI (no torch headers: builds in seconds with nvcc and loads with ctypes). Every entry point
// returns a cudaError_t value (0 = success) or one of the XS_ERR_* codes below for bad arguments.

#include <cuda_runtime.h>
#include <stdint.h>

#define XS_ERR_BAD_ARGUMENT 10001
#define XS_ERR_TOO_MANY_PRODUCERS 10002
#define XS_ERR_BUFFER_TOO_SMALL 10003

namespace {

constexpr int kHeader = 6;          // per-producer header words in the timestamp row
constexpr int kMaxBursts = 4096;    // 2 * kMaxBursts int64 timestamps live in shared memory
// More than half an SM's shared memory (228 KiB on Hopper), so no SM ever holds two producers.
constexpr int kSmemBytes = 120 * 1024;

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned int sm_id() {
  unsigned int s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}

// Grid barrier that also aligns the start (one thread per CTA): the last CTA to arrive publishes a start
// time `lead_ns` in the future on the global timer; everyone spins until then (all CTAs are co-resident:
// K <= SMs). sync_pair[0] counts arrivals, sync_pair[1] holds the start time (both zeroed by the launcher).
// A CTA that waits over 1 s (producers not co-resident) gives up and clears *aligned instead of hanging.
__device__ __forceinline__ void align_start(unsigned long long* sync_pair, int* aligned, unsigned long long lead_ns) {
  const unsigned long long t_enter = global_ns();
  const unsigned long long arrived = atomicAdd(&sync_pair[0], 1ull) + 1ull;
  if (arrived == gridDim.x) atomicExch(&sync_pair[1], global_ns() + lead_ns);
  unsigned long long go;
  while ((go = atomicAdd(&sync_pair[1], 0ull)) == 0ull) {
    if (global_ns() - t_enter > 1000000000ull) {
      *aligned = 0;
      go = global_ns();
      break;
    }
  }
  while (global_ns() < go) {
  }
}

// Row layout of `ts` (int64[num_producers][kHeader + 2 * num_bursts]):
//   [0] smid, [1] globaltimer at start, [2] globaltimer at end, [3] clock64 at start,
//   [4] clock64 at end, [5] 1 if every aligned start saw every producer (else 0), then
//   (issue_start_clock, issue_end_clock) per burst.
__global__ void __launch_bounds__(1024) burst_kernel(uint4* __restrict__ target, long long vec_per_producer,
                                                     int num_bursts, long long gap_iters,
                                                     int align_every_burst, long long* __restrict__ ts,
                                                     unsigned long long* sync, float* __restrict__ sink,
                                                     unsigned int tag) {
  extern __shared__ long long stamps[];
  const int p = blockIdx.x;
  const int tid = threadIdx.x;

  __shared__ int aligned;
  __shared__ int marker;
  if (tid == 0) {
    aligned = 1;
    marker = 0;
    align_start(&sync[0], &aligned, 2000ull);
  }
  __syncthreads();
  const unsigned long long g_start = global_ns();
  const long long c_start = clock64();

  uint4* __restrict__ dst = target + (long long)p * vec_per_producer;
  float acc = (float)tid;
  for (int b = 0; b < num_bursts; ++b) {
    if (align_every_burst && b > 0) {
      // Wait for the slowest producer's gap: the time spent here is part of this producer's gap (the
      // stage drains meanwhile), so it shows in the measured gap and period, not in the issue time.
      if (tid == 0) align_start(&sync[2 * b], &aligned, 1000ull);
    }
    __syncthreads();
    const long long t0 = clock64();
    for (long long i = tid; i < vec_per_producer; i += blockDim.x) {
      dst[i] = make_uint4(tag, (unsigned int)b, (unsigned int)p, (unsigned int)i);
    }
    // A store leaves the warp before its operands are read; a shared load queues behind the warp's
    // stores in the LSU pipe, and using its value waits for it, so the barrier is passed only once the
    // stores have really been accepted (a full post-issue stage stalls right here).
    acc += (float)*(volatile int*)&marker;
    __syncthreads();
    const long long t1 = clock64();
    if (tid == 0) {
      stamps[2 * b] = t0;
      stamps[2 * b + 1] = t1;
    }
    // The gap is useful arithmetic (a dependent FMA chain), not a sleep, so the SM stays busy.
    for (long long it = 0; it < gap_iters; ++it) {
#pragma unroll
      for (int j = 0; j < 16; ++j) acc = fmaf(acc, 0.9990234375f, 1.0f);
    }
  }
  if (acc == -1.2345f) sink[(long long)p * blockDim.x + tid] = acc;  // never true: keeps the FMAs
  __syncthreads();
  if (tid == 0) {
    const long long c_end = clock64();
    const unsigned long long g_end = global_ns();
    long long* row = ts + (long long)p * (kHeader + 2 * num_bursts);
    row[0] = sm_id();
    row[1] = (long long)g_start;
    row[2] = (long long)g_end;
    row[3] = c_start;
    row[4] = c_end;
    row[5] = aligned;
    for (int i = 0; i < 2 * num_bursts; ++i) row[kHeader + i] = stamps[i];
  }
}

// One thread per SM spins `spin_ns` on the global timer and reports (clock cycles, ns) elapsed.
__global__ void clock_probe_kernel(long long* out, long long spin_ns) {
  if (threadIdx.x != 0) return;
  const unsigned long long g0 = global_ns();
  const long long c0 = clock64();
  unsigned long long g1;
  while ((g1 = global_ns()) - g0 < (unsigned long long)spin_ns) {
  }
  const long long c1 = clock64();
  out[2 * blockIdx.x] = c1 - c0;
  out[2 * blockIdx.x + 1] = (long long)(g1 - g0);
}

}  // namespace

extern "C" {

int xs_burst_row_words(int num_bursts) { return kHeader + 2 * num_bursts; }
int xs_max_bursts() { return kMaxBursts; }

// target: device-visible address of >= target_bytes bytes; ts: device int64[K][kHeader + 2*num_bursts];
// sync: device uint64[xs_burst_sync_words(num_bursts)] (zeroed here); sink: device float[K * threads]
// (never written in practice). align_every_burst: 1 = a grid barrier aligns every burst's start, 0 = only
// the first burst is aligned and the producers free-run.
int xs_burst_sync_words(int num_bursts) { return 2 * num_bursts; }

int xs_burst_launch(void* target, long long target_bytes, long long bytes_per_producer, int num_producers,
                    int threads, int num_bursts, long long gap_iters, int align_every_burst, long long* ts,
                    unsigned long long* sync, float* sink, unsigned int tag, int device, void* stream) {
  if (target == nullptr || ts == nullptr || sync == nullptr || sink == nullptr) return XS_ERR_BAD_ARGUMENT;
  if (bytes_per_producer <= 0 || bytes_per_producer % 16 != 0) return XS_ERR_BAD_ARGUMENT;
  if (num_producers <= 0 || threads < 32 || threads > 1024 || threads % 32 != 0) return XS_ERR_BAD_ARGUMENT;
  if (num_bursts <= 0 || num_bursts > kMaxBursts || gap_iters < 0) return XS_ERR_BAD_ARGUMENT;
  if (target_bytes < bytes_per_producer * (long long)num_producers) return XS_ERR_BUFFER_TOO_SMALL;
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return err;
  int sms = 0;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  if (num_producers > sms) return XS_ERR_TOO_MANY_PRODUCERS;  // the start barrier needs co-residency
  err = cudaFuncSetAttribute(burst_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (align_every_burst != 0 && align_every_burst != 1) return XS_ERR_BAD_ARGUMENT;
  const int sync_words = align_every_burst ? xs_burst_sync_words(num_bursts) : 2;
  err = cudaMemsetAsync(sync, 0, sync_words * sizeof(unsigned long long), s);
  if (err != cudaSuccess) return err;
  burst_kernel<<<num_producers, threads, kSmemBytes, s>>>(static_cast<uint4*>(target), bytes_per_producer / 16,
                                                          num_bursts, gap_iters, align_every_burst, ts, sync,
                                                          sink, tag);
  return cudaGetLastError();
}

// out: device int64[2 * num_blocks]: per block (cycles, ns).
int xs_clock_probe(long long* out, int num_blocks, long long spin_ns, int device, void* stream) {
  if (out == nullptr || num_blocks <= 0 || spin_ns <= 0) return XS_ERR_BAD_ARGUMENT;
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return err;
  clock_probe_kernel<<<num_blocks, 32, 0, static_cast<cudaStream_t>(stream)>>>(out, spin_ns);
  return cudaGetLastError();
}

// Host-pinned memory mapped into the device's address space: stores to *dev_ptr cross PCIe.
int xs_host_alloc(long long bytes, int device, void** host_ptr, void** dev_ptr) {
  if (bytes <= 0 || host_ptr == nullptr || dev_ptr == nullptr) return XS_ERR_BAD_ARGUMENT;
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return err;
  err = cudaHostAlloc(host_ptr, (size_t)bytes, cudaHostAllocMapped | cudaHostAllocPortable);
  if (err != cudaSuccess) return err;
  err = cudaHostGetDevicePointer(dev_ptr, *host_ptr, 0);
  if (err != cudaSuccess) {
    cudaFreeHost(*host_ptr);
    *host_ptr = nullptr;
  }
  return err;
}

int xs_host_free(void* host_ptr) { return cudaFreeHost(host_ptr); }

int xs_stream_synchronize(void* stream) { return cudaStreamSynchronize(static_cast<cudaStream_t>(stream)); }

const char* xs_error_string(int code) {
  switch (code) {
    case XS_ERR_BAD_ARGUMENT: return "bad argument to the burst kernel launcher";
    case XS_ERR_TOO_MANY_PRODUCERS: return "more producers than SMs (producers must be co-resident)";
    case XS_ERR_BUFFER_TOO_SMALL: return "target buffer smaller than num_producers * bytes_per_producer";
    default: return cudaGetErrorString(static_cast<cudaError_t>(code));
  }
}

}  // extern "C"
