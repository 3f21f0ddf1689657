"""Type stubs for ferroattn._native, the Rust extension (src/python/).

This file is the contract between the Rust core and the Python layer. Tensors cross the
boundary through DLPack: any argument typed ``DLPackLike`` may be an object with
``__dlpack__``/``__dlpack_device__`` (a *detached* torch tensor, a CuPy or numpy array)
or a DLPack capsule. ``TensorMeta`` describes a tensor without data (for fake/meta tensors):
``(shape, strides_in_elements, dtype_name, (dl_device_type, device_id))`` where dtype_name is
one of "float16", "bfloat16", "float32", "float64", "int16", "int32", "int64", "uint8", "int8", "bool"
and dl_device_type is 1 (CPU) or 2 (CUDA).

Errors are raised as the classes of ferroattn.errors.
"""
from pathlib import Path
from typing import Protocol, Any, Callable, Optional, Sequence, Tuple, Union

DLPackLike = Any
TensorMeta = Tuple[Tuple[int, ...], Tuple[int, ...], str, Tuple[int, int]]

__version__: str

# ---- environment ------------------------------------------------------------------
def _configure(include_dirs: Sequence[str]) -> None:
    """Called once by ferroattn._env at import: extra CUDA include directories to search
    (site-packages nvidia/cu13/include), after $CUDA_HOME/include and /usr/local/cuda/include."""
def nvrtc_version() -> Optional[Tuple[int, int]]:
    """(major, minor) of the NVRTC library found, or None when it cannot be loaded."""
def header_dir() -> Optional[Path]:
    """The CUDA include directory NVRTC is given (holds cuda_fp16.h), or None."""
def cache_dir() -> Path:
    """The on-disk kernel cache directory ($FERROATTN_CACHE_DIR or ~/.cache/ferroattn)."""
def cuda_available() -> bool:
    """True when libcuda loads, cuInit succeeds and at least one GPU exists. Never raises."""
def env_switch(var: str, default: bool) -> bool:
    """The on / off environment switch ``var``: ``1`` / ``on`` True, ``0`` / ``off`` False, empty
    or unset ``default`` (src/env_switch.rs, the tuning knobs' on/off rule). Raises ArgumentError
    naming ``var`` for any other value."""
def set_tuning_knob(name: str, value: str) -> None:
    """Change one tuning knob for the rest of the process (``value`` in the text form of its
    environment variable, ``""`` for the default; e.g. ``set_tuning_knob("attn_fwd_family", "sm80")``;
    the knobs are listed in docs/DEVELOPING.md). Raises ArgumentError (a ValueError) naming ``name``
    for an unknown knob or a malformed value (the knobs are then unchanged), naming the argument
    that is not a str, or naming the environment variable when one is malformed."""
def tuning_knobs() -> dict:
    """{knob name: value in canonical text form} of every tuning knob (the environment's until
    ``set_tuning_knob`` changes one; each value can be passed back to ``set_tuning_knob``). Raises
    ArgumentError naming the environment variable when one is malformed."""
def device_info(ordinal: int = 0) -> dict:
    """{name, sm: (major, minor), arch: "sm_90a", sm_count, total_memory_bytes, driver_version}.
    Raises NoDeviceError when there is no driver/GPU."""

# ---- JIT --------------------------------------------------------------------------
def precompile_archs() -> list[str]:
    """The arch names :func:`precompile` takes ("sm_80", ..., "sm_90a", ...; "sm_90" is taken too,
    as sm_90a)."""

def precompile(archs: Sequence[str], check_spills: bool = False) -> list[dict]:
    """Compile every production configuration (src/tuning) for each arch ("sm_80", "sm_90a", ...),
    no GPU needed. One dict per kernel: {kernel, config, arch, registers, spill_stores,
    spill_loads, stack_bytes, static_smem_bytes, dynamic_smem_bytes, cubin_bytes,
    compile_seconds, from_cache}. Raises CompileError on a compile failure; with
    check_spills=True raises CompileError if any production configuration spills."""
def jit_stats() -> dict:
    """Counters of this process: {compiles, compile_seconds, disk_hits, disk_load_seconds,
    memory_hits, corrupt_rebuilt}."""
def clear_memory_cache() -> None:
    """Forget in-process compiled kernels (the disk cache stays); for tests and timing."""

# ---- attention --------------------------------------------------------------------
class AttnVariantLike(Protocol):
    """ferroattn.ops.variant.AttnVariant (read by attribute): causal, window_left, window_right,
    softcap, dropout_p and the tensors alibi_slopes, sinks, rng_state, s_dmask, s_dmask_max
    (DLPack tensors for a launch, TensorMeta tuples for a *_check call, or None)."""
    causal: bool
    window_left: int
    window_right: int
    softcap: float
    dropout_p: float
    alibi_slopes: object
    sinks: object
    rng_state: object
    s_dmask: object
    s_dmask_max: object

ATTN_FWD_PRODUCTS: int
ATTN_BWD_PRODUCTS: int
#: the most key splits per sequence of a kv-cache call (flash_attn's ``num_splits``)
ATTN_KVCACHE_MAX_SPLITS: int


def attn_flops(products: int, pairs: int, head_dim: int) -> int:
    """FLOPs of ``products`` attention products (``ATTN_FWD_PRODUCTS`` = 2: S = Q Kᵀ, O = P V;
    ``ATTN_BWD_PRODUCTS`` = 5: S, dP, dV, dK, dQ) over ``pairs`` visible (query, key) pairs summed
    over batch and query heads: ``2 · products · pairs · head_dim`` (the one formula every
    attention FLOP figure uses)."""
    ...


def attn_visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool, window_left: int, window_right: int) -> int:
    """(query, key) pairs of one (batch, head) that the mask shows (-1 = unbounded side)."""
def attn_fwd_check(
    q: TensorMeta, k: TensorMeta, v: TensorMeta,
    cu_seqlens_q: Optional[TensorMeta], cu_seqlens_k: Optional[TensorMeta],
    max_seqlen_q: int, max_seqlen_k: int, variant: Optional[AttnVariantLike] = None,
) -> None:
    """Validate attention-forward arguments from metadata alone (no data touched, usable on
    fake/meta tensors). Same checks, same errors as attn_fwd."""
def attn_fwd(
    q: DLPackLike, k: DLPackLike, v: DLPackLike, out: DLPackLike, softmax_lse: DLPackLike,
    cu_seqlens_q: Optional[DLPackLike], cu_seqlens_k: Optional[DLPackLike],
    max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, variant: AttnVariantLike, stream: int,
) -> None:
    """Launch attention forward on `stream` (raw CUstream; 0 = legacy default) in the primary
    context of q's device. Writes `out` (q's shape/dtype) and `softmax_lse` (fp32; (b, h, s_q)
    padded or (h, total_q) varlen). Validates everything before launching; never synchronises.
    head_dim must already be a multiple of 8 (the Python wrapper pads). Any batch up to 2**31 - 1:
    a batch of more than 65535 (the grid's limit) runs as one launch per slice of at most 65535
    entries, with no allocation or sync between them. `stream` must be a live
    CUstream of q's device (as for any CUDA driver call, a made-up handle is undefined behaviour
    and may crash the process; an int outside [0, 2**64) raises ArgumentError)."""

def attn_fwd_fast(
    q: Any, k: Any, v: Any, dropout_p: Any, softmax_scale: Any, causal: Any, window_size: Any, softcap: Any,
    alibi_slopes: Any, deterministic: Any, return_attn_probs: Any, s_aux: Any, /,
) -> Optional[Any]:
    """``flash_attn_func``'s arguments, positional only, in its order: the common plain or causal eager call
    launched in this one call, returning ``out`` (``torch.empty_like(q)``, fully written; the
    softmax_lse it also writes is dropped), or None when the call must take the Python path
    (src/ops/attention/fast.rs lists what is taken: exact argument types of the plain variant,
    the eager rule, a padded tile-aligned 16-bit layout that needs no pad or copy, not
    decode-shaped, q's device current). Raises only what the launch raises (the validation's
    errors, CUDA / NVRTC errors)."""
def attn_kvcache_fast(
    q: Any, k_cache: Any, v_cache: Any, k: Any, v: Any, rotary_cos: Any, rotary_sin: Any, cache_seqlens: Any,
    cache_batch_idx: Any, cache_leftpad: Any, block_table: Any, softmax_scale: Any, causal: Any, window_size: Any,
    softcap: Any, rotary_interleaved: Any, alibi_slopes: Any, num_splits: Any, return_softmax_lse: Any, /,
) -> Optional[Any]:
    """``flash_attn_with_kvcache``'s arguments, positional only, in its order: the common call (a contiguous-row
    cache of q's batch, an optional append of k / v at an int32 ``cache_seqlens``, no rotary,
    paging, batch index or left pad, the plain or causal variant, exact argument types, the eager
    rule; src/ops/attention/fast.rs ``fast_kvcache``) launched in this one call: the append, then
    the kv-cache kernel. Returns ``out`` or ``(out, softmax_lse)``, or None when the call must take
    the Python path. Raises only what the launches raise."""
def eager_plain(tensors: Sequence[Optional[Any]], device_types: Sequence[str]) -> bool:
    """The eager fast path's rule past its switch and ``is_compiling`` (ops/_eager.py documents
    it): plain tensor types, nothing for autograd to record, no lazy negation / conjugation
    bit, the first tensor's device type in ``device_types``, no torch function / dispatch mode,
    the autograd profiler off, no functorch transform, not jit-traced."""
def attn_kvcache_check(
    q: TensorMeta, k_cache: TensorMeta, v_cache: TensorMeta, cu_seqlens_q: Optional[TensorMeta],
    cu_seqlens_k: Optional[TensorMeta], max_seqlen_q: int, cache_seqlens: Optional[TensorMeta], seqlen_k_add: int,
    cache_leftpad: Optional[TensorMeta], cache_batch_idx: Optional[TensorMeta], block_table: Optional[TensorMeta],
    variant: AttnVariantLike,
) -> None:
    """Validate a kv-cache attention call from metadata alone (the checks and errors of attn_fwd_kvcache)."""
def attn_kvcache_num_splits(device: int, batch: int, seqlen_q: int, heads: int, heads_k: int, key_len: int,
                            head_dim: int, paged: bool, num_splits: int) -> int:
    """Key splits per sequence of a kv-cache call on `device` (num_splits 0 = heuristic, 1..128 kept);
    ArgumentError outside [0, 128]. The caller sizes the split partials from it."""
def attn_use_kvcache_path(seqlen_q: int, group: int, seqlen_k: int, dropout: bool) -> bool:
    """Whether a flash_attn_func / varlen call of these sizes runs on the kv-cache kernel."""
def attn_decode_rows_fit(seqlen_q: int, group: int) -> bool:
    """Whether seqlen_q queries of a GQA group of `group` heads are few enough for the kv-cache
    kernel (at most two blocks of packed rows per kv head)."""
def attn_fwd_kvcache(
    q: DLPackLike, k_cache: DLPackLike, v_cache: DLPackLike, out: DLPackLike, softmax_lse: DLPackLike,
    cu_seqlens_q: Optional[DLPackLike], cu_seqlens_k: Optional[DLPackLike], max_seqlen_q: int,
    cache_seqlens: Optional[DLPackLike], seqlen_k_add: int, cache_leftpad: Optional[DLPackLike],
    cache_batch_idx: Optional[DLPackLike], block_table: Optional[DLPackLike], o_accum: Optional[DLPackLike],
    lse_accum: Optional[DLPackLike], softmax_scale: float, variant: AttnVariantLike, stream: int,
) -> None:
    """Launch the split-KV attention forward over a key/value cache (src/ops/attention/kvcache.rs) and,
    with the fp32 partials o_accum (splits, b, h, s_q, d) / lse_accum (splits, b, h, s_q), their
    combine, on `stream`. Validates everything first; never synchronises."""
def kv_append_check(
    k_cache: TensorMeta, v_cache: TensorMeta, k: TensorMeta, v: TensorMeta, q: Optional[TensorMeta],
    q_rot: Optional[TensorMeta], rotary_cos: Optional[TensorMeta], rotary_sin: Optional[TensorMeta],
    cache_seqlens: Optional[TensorMeta], cache_batch_idx: Optional[TensorMeta], block_table: Optional[TensorMeta],
) -> None:
    """Validate a cache append from metadata alone (the checks and errors of kv_append)."""
def kv_append(
    k_cache: DLPackLike, v_cache: DLPackLike, k: DLPackLike, v: DLPackLike, q: Optional[DLPackLike],
    q_rot: Optional[DLPackLike], rotary_cos: Optional[DLPackLike], rotary_sin: Optional[DLPackLike],
    cache_seqlens: DLPackLike, cache_batch_idx: Optional[DLPackLike], block_table: Optional[DLPackLike],
    rotary_interleaved: bool, q_per_token: bool, stream: int,
) -> None:
    """Write k (rotated) and v into the cache at cache_seqlens (in place; positions past the cache and
    indices outside it are skipped) and q rotated into q_rot, on `stream`."""

def attn_bwd_check(
    dout: TensorMeta, q: TensorMeta, k: TensorMeta, v: TensorMeta, out: TensorMeta,
    softmax_lse: TensorMeta, cu_seqlens_q: Optional[TensorMeta], cu_seqlens_k: Optional[TensorMeta],
    max_seqlen_q: int, max_seqlen_k: int, variant: Optional[AttnVariantLike] = None,
) -> None:
    """Validate attention-backward arguments from metadata alone (usable on fake/meta tensors):
    everything attn_fwd_check checks for q, k, v, cu_seqlens and max_seqlen, plus out and dout
    with q's shape and dtype (any strides with stride(-1) == 1) and softmax_lse fp32 with the
    forward's LSE shape ((b, h, s_q) padded, (h, total_q) varlen), contiguous. Same errors as
    attn_bwd."""
def attn_bwd(
    dout: DLPackLike, q: DLPackLike, k: DLPackLike, v: DLPackLike, out: DLPackLike,
    softmax_lse: DLPackLike, dq: DLPackLike, dk: DLPackLike, dv: DLPackLike,
    softmax_d: DLPackLike, dq_accum: Optional[DLPackLike],
    cu_seqlens_q: Optional[DLPackLike], cu_seqlens_k: Optional[DLPackLike],
    max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, variant: AttnVariantLike,
    deterministic: bool, stream: int,
) -> None:
    """Launch attention backward (FlashAttention-2 paper, §3.2) on `stream`, in the primary context
    of q's device: the kernels of tuning::attention_bwd::bwd_plan, in order. Reads dout, q, k,
    v, out (the forward's output) and softmax_lse (the forward's LSE); writes dq (q's shape and
    dtype), dk and dv (k's / v's shape and dtype; with GQA the sum over each kv head's query
    heads), softmax_d (fp32, softmax_lse's shape, contiguous: rowsum(dout * out)) and uses
    dq_accum (fp32, q's shape with head_dim columns, contiguous) as workspace: required when
    deterministic is False (zeroed by the preprocess kernel, accumulated with atomics), ignored
    and may be None when True (no atomics: bitwise reproducible). dq/dk/dv may have any strides
    with stride(-1) == 1 (16-byte aligned rows); they must not overlap each other or the inputs.
    Validates everything before launching; never synchronises. Empty problems launch nothing
    except that dk/dv rows no query sees are written as 0. A batch of more than 65535 runs the
    plan once per slice of at most 65535 entries, as attn_fwd does. softmax_scale must be finite and > 0
    (the Python layer maps scale <= 0 as in the forward). `stream` as for attn_fwd."""

# ---- DLPack -----------------------------------------------------------------------
def dlpack_info(x: DLPackLike) -> dict:
    """Import x zero-copy and describe it: {data_ptr (data + byte_offset), shape, strides
    (elements), dtype, device: (type, id), byte_offset, versioned: bool}."""

class Buffer:
    """A Rust-allocated buffer (host memory or CUDA device memory via cuMemAlloc) exported
    zero-copy through DLPack; freed by the DLPack deleter when the last consumer drops it."""
    @staticmethod
    def empty(shape: Sequence[int], dtype: str, device: str = "cpu") -> "Buffer": ...
    @property
    def data_ptr(self) -> int: ...
    @property
    def shape(self) -> Tuple[int, ...]: ...
    @property
    def dtype(self) -> str: ...
    def __dlpack__(self, *, stream: Optional[int] = None, max_version: Optional[Tuple[int, int]] = None,
                   dl_device: Optional[Tuple[int, int]] = None, copy: Optional[bool] = None) -> Any: ...
    def __dlpack_device__(self) -> Tuple[int, int]: ...

def live_buffers() -> int:
    """Number of Rust-allocated buffers not yet freed (for leak tests)."""

# ---- profiler: launch records of our kernels (issue 5) -------------------------------
def profiler_enable(enabled: bool) -> None:
    """Turn the recording of our kernel launches on or off, process-wide (every thread, every
    device). While on, each launch made through src/launch.rs on a stream that is not capturing
    a CUDA graph is bracketed by a pair of timing events (cuEventRecord on the launch's stream,
    events taken from a pool) and described in a record kept until profiler_drain. Launches on a
    capturing stream are not recorded (counted in profiler_stats()["skipped_capture"]). Off (the
    default) a launch pays one relaxed atomic load. Turning it off keeps undrained records. At
    most 1_000_000 records are kept; launches beyond that are counted as "dropped"."""
def profiler_enabled() -> bool:
    """Whether launch recording is on."""
def profiler_stats() -> dict:
    """{enabled: bool, pending: int (records not drained), skipped_capture: int, dropped: int}
    (the counters count since the process started; dropped also counts marks refused at the
    cap of profiler_mark)."""
def profiler_drain(reference_event: Optional[int] = None) -> list[dict]:
    """Resolve and return every record kept so far, in launch order, and forget them (the pool
    gets the events back). Waits for each record's end event (cuEventSynchronize): call it
    outside the region being timed.

    reference_event: a CUevent handle as an int (e.g. ``torch.cuda.Event(enable_timing=True)``
    after ``.record()``: its ``.cuda_event``), recorded on the records' device before their
    launches. ``start_ms`` = cuEventElapsedTime(reference_event, start) in ms; None without a
    reference, or where the driver refuses (another device, event never recorded).

    One dict per launch: {seq: int (launch order since process start), op: str
    ("ferroattn::attn_fwd", "ferroattn::attn_bwd"), kernel: str (short kernel name, e.g.
    "attn_fwd_sm80", "attn_bwd_preprocess", "attn_bwd_dkdv_sm80", "attn_bwd_dq_sm80",
    "attn_bwd_convert_dq"), config: str (the configuration's name expression, as compiled),
    arch: str ("sm_90a"), device: int, stream: int (raw CUstream), grid: (x, y, z), block:
    (x, y, z), dynamic_smem_bytes: int, static_smem_bytes: int, registers: int (per thread),
    max_active_blocks_per_sm: int (cuOccupancyMaxActiveBlocksPerMultiprocessor), occupancy: float
    (theoretical: max_active_blocks_per_sm * warps per block / max warps per SM, in [0, 1]),
    flops: float (the tensor-core products the launch performs: 2*m*n*k per product over the
    (query, key) pairs it visits that are not masked, causal bottom-right counted exactly;
    0 for the preprocess/convert kernels), bytes: float (compulsory global-memory traffic:
    every tensor the launch reads or writes counted once, in bytes), exact: bool (False when
    lengths live on the device, i.e. varlen: flops/bytes then assume every sequence has
    total/batch tokens), gpu_ms: float (cuEventElapsedTime(start, end)), start_ms: Optional[float]}.
    A call whose batch is split over launches (more than 65535 entries) gives one record per
    launch, each counting its slice: their flops add up to the call's.

    Raises CudaError when an event cannot be resolved (e.g. a sticky error); the records are
    forgotten anyway."""

# Marks: single timing events for the module hooks (python/ferroattn/profiler/clocks.py, NativeClock), from the
# same per-device event pools as the launch records. Independent of profiler_enable.
def profiler_mark(stream: int, device: int) -> int:
    """Record a mark: a pooled timing event of ``device`` recorded on ``stream`` (a raw CUstream
    of that device as an int, e.g. ``torch._C._cuda_getCurrentRawStream(device)``; 0 = its legacy
    default stream) now, in stream order; makes ``device``'s primary context current on this
    thread first. Returns the mark's id (an int > 0; ids are never reused), or 0 when nothing was
    recorded: ``stream`` is capturing a CUDA graph, or 2_000_000 marks are unresolved (counted in
    profiler_stats()["dropped"]). Host cost: cuStreamIsCapturing, one cuEventRecord and the pool
    bookkeeping (no sync); the context is bound only when the thread's current one changed.
    Raises ArgumentError (device < 0), TypeError (not ints), NoDeviceError (no such device),
    CudaError (cuEventCreate/cuEventRecord failed, e.g. a stream of another device)."""
def profiler_marks_query(marks: Sequence[int]) -> list[bool]:
    """Whether the GPU has passed each mark (cuEventQuery; never waits). ArgumentError naming
    ``marks`` for an id that is not an unresolved mark; CudaError on a driver error."""
def profiler_marks_resolve(marks: Sequence[int], reference_event: Optional[int] = None) -> list[Optional[float]]:
    """Milliseconds (cuEventElapsedTime) from ``reference_event`` (a CUevent handle as an int,
    e.g. a recorded ``torch.cuda.Event``'s ``.cuda_event``, recorded before the marks; None or 0:
    the first mark of ``marks``) to each mark, in the order given (negative when the mark came
    first; None where the driver refuses, e.g. a reference of another device). Waits for every
    mark (cuEventSynchronize; GIL released), then forgets the marks and returns their events to
    the pool, also when it fails. ArgumentError naming ``marks``, and nothing forgotten, when an
    id is not an unresolved mark (never made, resolved or released already, or listed twice);
    CudaError when an event cannot be waited for."""
def profiler_marks_release(marks: Sequence[int]) -> int:
    """Forget marks without timing them (their events go back to the pool); ids that are not
    unresolved marks are ignored. Returns how many were released."""
class ProfilerForward:
    """The module hooks' per-call path as one native callable (python/ferroattn/profiler/hooks.py,
    wrap mode; attach() builds it, and its contract is the Python wrapper there, mirrored step for
    step): stored as a hooked module's instance ``forward``. ``__call__(*args, **kwargs)``: when
    ``att._live`` and not ``kill[0]``, appends the call entry ``[name, kind, depth, att.step, start
    mark, end mark, shapes, module, record_function range]`` to ``calls`` and ``stack`` (shapes of
    the tensor positional arguments when ``shapes``; a ``record_function`` range via
    ``open_rf(name)`` while ``probe()``; ``push(name)``), calls ``inner(*args, **kwargs)`` and closes
    the entry (end mark, ``pop()``, the range's ``__exit__``; ``close(entry)`` when the entry is not
    the top of ``stack``), also when ``inner`` raises; else just calls ``inner``. Marks: ``mark()``
    when given, else native marks of ``device`` on ``raw_stream(device)`` recorded from Rust (as
    profiler_mark, except that the capture check of the legacy stream runs once per root call:
    the call at depth 0). Has an instance ``__dict__``; takes part in cyclic GC."""
    def __init__(self, *, inner: Callable, att: Any, name: str, kind: str, module: Any, stack: list, calls: list,
                 kill: list, close: Callable, raw_stream: Optional[Callable[[int], int]], device: int,
                 mark: Optional[Callable[[], Any]], probe: Optional[Callable[[], bool]], open_rf: Callable,
                 push: Optional[Callable[[str], Any]], pop: Optional[Callable[[], Any]], tensor: type,
                 shapes: bool) -> None:
        """Every argument by keyword: a missing one is a KeyError naming it, a mistyped one a
        TypeError naming it."""
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

# ---- dense GEMM (issue 4) -----------------------------------------------------------
# out[i] = act(alpha * a[i] @ b[i] + beta * c[i] + bias)   for i in range(batch)
# (the cuBLASLt epilogue order: scale, add C, add bias, activate; fp32 accumulation and
# epilogue, rounded once to out's dtype).
#   a: (batch, m, k), b: (batch, k, n): fp16 or bf16 (the same dtype); any strides where one of
#      the last two dims has stride 1 (row-major: stride(-1) == 1, column-major: stride(-2) == 1;
#      a dim of size 1 counts as either); batch stride may be 0 (broadcast); any alignment.
#   out: (batch, m, n), fp16, bf16 or fp32, stride(-1) == 1 (any row stride, batch stride != 0
#      unless batch == 1); must not overlap a, b, c, bias or aux.
#   c: None or (batch, m, n) of out's dtype, stride(-1) == 1, batch stride may be 0; required
#      when beta != 0, ignored when beta == 0.
#   bias: None or (n,), contiguous, dtype a's dtype or float32.
#   aux: None or like out (same shape, dtype, strides rules): when given, the pre-activation
#      value alpha*a@b + beta*c + bias is also written there (for the backward of an activation).
#   activation: "none" | "relu" | "gelu_tanh" | "gelu_erf" | "silu" (kernels/common/activation.cuh).
#   m, n, k, batch >= 1 (k == 0 is handled by the Python layer); batch up to at least 2**20;
#   64-bit offsets everywhere.
#   backend: "auto" (the fastest supported path for this problem on this device), "wmma"
#      (kernels/gemm/wmma.cuh, sm_80+), "sm90" (kernels/gemm/sm90.cuh, wgmma + TMA, sm_90a only).
#      An explicit backend that cannot run this problem (or this device) raises ArgumentError
#      naming `backend`, the supported backends and the reason.
#   workspace: the split-k / stream-K workspace (src/ops/workspace.rs), allocated by the caller:
#      None when gemm_workspace(...) is 0, else a uint8 CUDA tensor (one dim, contiguous, 16-byte
#      aligned, on a's device, overlapping no other argument) of at least gemm_workspace(...)
#      bytes; or a callable alloc(nbytes, device) -> such a tensor, which the launch calls once
#      with exactly those bytes (not when they are 0); anything else raises ArgumentError /
#      DTypeError / DeviceError naming `workspace`.
#      Its counters are zeroed by the launch on `stream` (a memset node under graph capture).
def gemm_check(
    a: TensorMeta, b: TensorMeta, out: TensorMeta, c: Optional[TensorMeta],
    bias: Optional[TensorMeta], aux: Optional[TensorMeta], beta: float, activation: str,
) -> None:
    """Validate GEMM arguments from metadata alone (fake/meta tensors): same checks, same
    errors as gemm (ArgumentError / DTypeError / DeviceError naming the argument, the expected
    and the actual value)."""
def gemm_workspace(
    a: DLPackLike, b: DLPackLike, out: DLPackLike, c: Optional[DLPackLike],
    bias: Optional[DLPackLike], aux: Optional[DLPackLike], alpha: float, beta: float,
    activation: str, backend: str, /,
) -> int:
    """Bytes of the workspace a gemm call with these arguments needs (0: none): the sm90 split-k
    chunks (splits x m x n fp32) or the wmma stream-k tail (a partial tile per CTA + flags). Runs
    gemm's validation (same errors) and its plan on a's device (SM count, tuning knobs).
    Positional only; another argument count raises ArgumentError naming gemm_workspace."""
def gemm(
    a: DLPackLike, b: DLPackLike, out: DLPackLike, c: Optional[DLPackLike],
    bias: Optional[DLPackLike], aux: Optional[DLPackLike], alpha: float, beta: float,
    activation: str, backend: str, workspace: Optional[Union[DLPackLike, Callable[[int, int], Any]]], stream: int,
) -> str:
    """Launch the GEMM on `stream` (raw CUstream, as for attn_fwd) in the primary context of a's
    device; validates everything first; never synchronises. Returns the backend that ran
    ("wmma" or "sm90"). Launch records (profiler) carry op "ferroattn::gemm", flops 2*batch*m*n*k
    and the compulsory bytes."""
def gemm_backends(device: int = 0) -> list[str]:
    """The backends this device supports, fastest first (e.g. ["sm90", "wmma"] on an H100/H200,
    ["wmma"] on an A100). Raises NoDeviceError without a GPU."""

# ---- 2:4 structured sparsity (issue 4) --------------------------------------------------
# A 2:4 matrix w (m, k) keeps at most 2 non-zeros in every aligned group of 4 along k.
# Compressed form: values (m_pad, k_pad / 2) of w's dtype (the kept elements of each group, in
# order; a group with fewer than 2 non-zeros keeps zeros) + meta (int16, sparse24_layout's
# meta_shape) in the layout the kernels read (src/ops/sparse24/host.rs documents it and is the
# reference). m_pad, k_pad: w's shape rounded up to the kernels' tile multiples; padding is zero.
def sparse24_layout(m: int, k: int) -> dict:
    """{m_pad, k_pad, values_shape: (m_pad, k_pad // 2), meta_shape: (rows, cols) int16,
    tile_m, tile_k}: the shapes compress writes for a (m, k) matrix. Pure function (no GPU)."""
def sparse24_compress(
    w: DLPackLike, values: DLPackLike, meta: DLPackLike, bad_groups: DLPackLike,
    prune: bool, stream: int,
) -> None:
    """GPU kernel. w: (m, k) fp16/bf16, CUDA, stride(-1) == 1. Writes values, meta (shapes of
    sparse24_layout(m, k), contiguous, values of w's dtype) and bad_groups (int32 (1,), set,
    not accumulated): the number of groups with more than 2 non-zeros. prune=False: such groups
    keep their first two non-zeros (the Python layer raises ValueError when bad_groups > 0);
    prune=True: every group keeps its two largest magnitudes (ties: the lower index)."""
def sparse24_decompress(values: DLPackLike, meta: DLPackLike, out: DLPackLike, stream: int) -> None:
    """GPU kernel: out (m, k) (w's shape and dtype, stride(-1) == 1) from values + meta; the
    inverse of compress on 2:4 inputs, bitwise."""
def sparse24_compress_host(w: DLPackLike, values: DLPackLike, meta: DLPackLike, prune: bool) -> int:
    """The Rust CPU reference of sparse24_compress on host tensors (same shapes, dtypes, rules);
    returns bad_groups. Used by CI and by the GPU tests as the oracle."""
def sparse24_decompress_host(values: DLPackLike, meta: DLPackLike, out: DLPackLike) -> None:
    """The Rust CPU reference of sparse24_decompress on host tensors."""
def sparse24_matmul_check(
    x: TensorMeta, values: TensorMeta, meta: TensorMeta, out: TensorMeta,
    bias: Optional[TensorMeta], n: int, k: int, activation: str,
) -> None:
    """Validate sparse24_matmul arguments from metadata alone (same checks and errors)."""
def sparse24_matmul_workspace(
    x: DLPackLike, values: DLPackLike, meta: DLPackLike, out: DLPackLike,
    bias: Optional[DLPackLike], n: int, k: int, activation: str, backend: str, /,
) -> int:
    """Bytes of the workspace a sparse24_matmul call with these arguments needs (0: none; only
    wgmma_sp's split-k (chunks of fp32), fused split-k (a slot + a counter per tile) and stream-K
    (a slot + a counter per CTA) schedules have one). Runs sparse24_matmul's checks (same errors)
    and its plan on x's device. Positional only; another argument count raises ArgumentError
    naming sparse24_matmul_workspace."""
def sparse24_matmul(
    x: DLPackLike, values: DLPackLike, meta: DLPackLike, out: DLPackLike,
    bias: Optional[DLPackLike], n: int, k: int, activation: str, backend: str,
    workspace: Optional[Union[DLPackLike, Callable[[int, int], Any]]], stream: int,
) -> str:
    """out = act(x @ w.T + bias) (torch.nn.functional.linear semantics) with w (n, k) the 2:4
    matrix compressed into values/meta (n rows = output features). x: (rows, k) fp16/bf16 with
    stride(-1) == 1 (the Python layer flattens leading dims; rows >= 1, any rows incl. 1..31),
    out: (rows, n) x's dtype, stride(-1) == 1; bias None or (n,) x's dtype or float32.
    backend: "auto" | "mma_sp" (mma.sp, sm_80+) | "wgmma_sp" (wgmma .sp, sm_90a, x rows 16-byte
    aligned; FERROATTN_SPARSE24_WGMMA=0 disables it). "auto" runs wgmma_sp from 46 rows where it
    can run, else mma_sp. wgmma_sp splits k into chunks (an fp32 workspace + a reduce kernel) when
    its tiles would leave SMs idle: FERROATTN_SPARSE24_SPLITK = "auto" (the cost rule) | "off" | N.
    workspace: None when sparse24_matmul_workspace(...) is 0, else a uint8 CUDA tensor of at least
    that many bytes, or an allocator called for them, with gemm's workspace rules (errors name
    `workspace`). Returns the backend that ran. Malformed values/meta shapes or dtypes raise ArgumentError; no meta bit pattern
    can make the kernel access memory outside the tensors. Profiler op "ferroattn::sparse24_matmul",
    flops counted dense (2*rows*n*k)."""
