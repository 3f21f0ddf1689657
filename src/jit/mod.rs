//! Run-time compilation of the kernels in kernels/: NVRTC → CUBIN → CUfunction.
//!
//! A kernel specialisation is a [`KernelSpec`] (e.g. `tuning::attention::AttnFwdConfig`):
//! it names its header, its template instantiation and its arch. [`KernelMap::get`] is the
//! hot path: a read-locked hash lookup keyed by (spec, device). A miss reads the disk
//! cache (cache.rs) or compiles (nvrtc.rs), then loads the module into the device's
//! primary context. Loaded modules are never unloaded (a queued launch may still use them).

pub mod cache;
pub mod headers;
pub mod nvrtc;
pub mod precompile;
pub mod ptxas;
pub mod sources;

use crate::arch::Arch;
use crate::error::{CudaResultExt, Result};
use cudarc::driver::{result as cu, sys};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{OnceLock, RwLock};
use std::time::Instant;

/// One kernel specialisation: everything needed to compile, cache and load it.
pub trait KernelSpec:
    Copy + Eq + std::hash::Hash + Send + Sync + std::fmt::Debug + 'static
{
    /// The kernel template, e.g. "ferroattn::attn_fwd_sm80".
    fn kernel(&self) -> &'static str;
    /// The file under kernels/ that defines it, e.g. "attention/fwd_sm80.cuh".
    fn header(&self) -> &'static str;
    /// The NVRTC name expression that instantiates it.
    fn name_expression(&self) -> String;
    fn arch(&self) -> Arch;
    /// Dynamic shared memory per block (set as the function's maximum at load).
    fn dynamic_smem_bytes(&self) -> u32;
    /// The program NVRTC compiles: by default just the include of `header()`.
    fn program(&self) -> String {
        format!("#include \"{}\"\n", self.header())
    }
}

/// `impl KernelSpec` for a tuning config with an `arch: Arch` field and an inherent
/// `name_expression(&self) -> String`; `kernel`, `header` and `smem` (dynamic shared memory
/// bytes) are expressions of the config bound by `|c|`, e.g. `smem: |c| c.smem_bytes()`.
/// With `smem` alone, `kernel` and `header` are the config's inherent methods of those names.
/// `KernelSpec` must be in scope where it is used.
macro_rules! impl_kernel_spec {
    ($ty:ident, kernel: |$k:pat_param| $kernel:expr, header: |$h:pat_param| $header:expr, smem: |$s:pat_param| $smem:expr $(,)?) => {
        impl KernelSpec for $ty {
            fn kernel(&self) -> &'static str {
                let $k = self;
                $kernel
            }
            fn header(&self) -> &'static str {
                let $h = self;
                $header
            }
            fn name_expression(&self) -> String {
                $ty::name_expression(self)
            }
            fn arch(&self) -> $crate::arch::Arch {
                self.arch
            }
            fn dynamic_smem_bytes(&self) -> u32 {
                let $s = self;
                $smem
            }
        }
    };
    ($ty:ident, smem: |$s:pat_param| $smem:expr $(,)?) => {
        $crate::jit::impl_kernel_spec!($ty, kernel: |c| $ty::kernel(c), header: |c| $ty::header(c), smem: |$s| $smem);
    };
}
pub(crate) use impl_kernel_spec;

/// Digest of every embedded kernel source (part of every cache key).
fn sources_digest() -> &'static str {
    static D: OnceLock<String> = OnceLock::new();
    D.get_or_init(|| {
        let mut text = String::new();
        for (path, src) in sources::SOURCES {
            text.push_str(path);
            text.push('\0');
            text.push_str(src);
            text.push('\0');
        }
        cache::digest(&text)
    })
}

/// The full cache key text of `spec` (hashed for the file name, stored in the file).
pub fn cache_key<K: KernelSpec>(spec: &K, options: &[String], nvrtc: (i32, i32)) -> String {
    format!(
        "ferroattn-cubin-v1\nnvrtc={}.{}\narch={}\nname={}\noptions={}\nsources={}\nprogram={}",
        nvrtc.0,
        nvrtc.1,
        spec.arch().name(),
        spec.name_expression(),
        options.join(" "),
        sources_digest(),
        spec.program(),
    )
}

/// A CUBIN for `spec` and how it was obtained.
pub struct Obtained {
    pub compiled: nvrtc::Compiled,
    pub from_cache: bool,
    /// Seconds spent in NVRTC (0 for a disk hit).
    pub compile_seconds: f64,
}

/// The CUBIN of `spec` from the disk cache, or compiled (and then written to the cache).
pub fn obtain<K: KernelSpec>(spec: &K) -> Result<Obtained> {
    obtain_in(&cache::cache_dir(), spec)
}

/// `obtain` with the disk cache rooted at `dir`.
pub fn obtain_in<K: KernelSpec>(dir: &std::path::Path, spec: &K) -> Result<Obtained> {
    let version = nvrtc::version()?;
    let options = nvrtc::options(spec.arch())?;
    let key = cache_key(spec, &options, version);
    let path = cache::path_for(dir, version, spec.arch().name(), &key);
    let t = Instant::now();
    match cache::read(&path, &key) {
        cache::Lookup::Hit(compiled) => {
            cache::add_seconds(&cache::STATS.disk_load_nanos, t);
            cache::STATS.disk_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(Obtained {
                compiled,
                from_cache: true,
                compile_seconds: 0.0,
            });
        }
        cache::Lookup::Corrupt(_) => {
            cache::STATS.corrupt_rebuilt.fetch_add(1, Ordering::Relaxed);
        }
        cache::Lookup::Miss => {}
    }
    let t = Instant::now();
    let compiled = nvrtc::compile(
        &spec.program(),
        &spec.name_expression(),
        &options,
        spec.arch().name(),
    )?;
    let compile_seconds = cache::add_seconds(&cache::STATS.compile_nanos, t);
    cache::STATS.compiles.fetch_add(1, Ordering::Relaxed);
    // A cache that cannot be written (read-only home, full disk) only costs a recompile later.
    let _ = cache::write(&path, &key, &compiled);
    Ok(Obtained {
        compiled,
        from_cache: false,
        compile_seconds,
    })
}

/// A kernel loaded into a device's primary context.
#[derive(Debug)]
pub struct Kernel {
    function: sys::CUfunction,
    pub lowered_name: String,
    pub dynamic_smem_bytes: u32,
    /// The kernel's short name: `KernelSpec::kernel()` without its namespace, e.g. "attn_fwd_sm80".
    pub name: &'static str,
    /// The NVRTC name expression it was compiled from (`KernelSpec::name_expression()`).
    pub name_expression: String,
    pub arch: Arch,
}
// SAFETY: a CUfunction handle is a process-wide driver object usable from any thread.
unsafe impl Send for Kernel {}
unsafe impl Sync for Kernel {}

impl Kernel {
    pub fn function(&self) -> sys::CUfunction {
        self.function
    }
}

/// `kernel` without its namespace ("ferroattn::attn_fwd_sm80" -> "attn_fwd_sm80").
fn short_name(kernel: &'static str) -> &'static str {
    kernel.rsplit("::").next().unwrap_or(kernel)
}

/// Load the CUBIN of `spec` on `device` and look up its entry function.
fn load<K: KernelSpec>(compiled: &nvrtc::Compiled, device: i32, spec: &K) -> Result<Kernel> {
    let dynamic_smem_bytes = spec.dynamic_smem_bytes();
    crate::device::bind(device)?;
    let t = Instant::now();
    // SAFETY: `cubin` is a complete CUBIN image produced by NVRTC.
    let module = unsafe { cu::module::load_data(compiled.cubin.as_ptr() as *const _) }
        .call("cuModuleLoadData")?;
    let name =
        std::ffi::CString::new(compiled.lowered_name.clone()).expect("lowered name has no NUL");
    // SAFETY: `module` was just loaded.
    let function = unsafe { cu::module::get_function(module, name) }.call("cuModuleGetFunction")?;
    // SAFETY: valid function; raises the dynamic smem ceiling above the 48 KiB default.
    unsafe {
        cu::function::set_function_attribute(
            function,
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            dynamic_smem_bytes as i32,
        )
    }
    .call("cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")?;
    cache::add_seconds(&cache::STATS.module_load_nanos, t);
    cache::STATS.module_loads.fetch_add(1, Ordering::Relaxed);
    Ok(Kernel {
        function,
        lowered_name: compiled.lowered_name.clone(),
        dynamic_smem_bytes,
        name: short_name(spec.kernel()),
        name_expression: spec.name_expression(),
        arch: spec.arch(),
    })
}

/// Bumped by `clear_memory_cache`: entries from an older generation count as misses.
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// Forget every in-process kernel (the disk cache stays).
pub fn clear_memory_cache() {
    GENERATION.fetch_add(1, Ordering::Relaxed);
}

/// (spec, device) → (generation loaded in, kernel).
type Entries<K> = HashMap<(K, i32), (u64, &'static Kernel)>;

/// In-process map (spec, device) → loaded kernel, one per kernel family (a `static`).
pub struct KernelMap<K: KernelSpec> {
    map: OnceLock<RwLock<Entries<K>>>,
}

impl<K: KernelSpec> KernelMap<K> {
    pub const fn new() -> Self {
        KernelMap {
            map: OnceLock::new(),
        }
    }

    /// The loaded kernel for `spec` on `device`: compiled or read from disk and loaded on
    /// the first call, a shared-lock hash lookup afterwards. Blocking on a miss (release
    /// the GIL around it). Two threads missing together may both compile; one wins.
    pub fn get(&self, spec: &K, device: i32) -> Result<&'static Kernel> {
        let map = self.map.get_or_init(Default::default);
        let generation = GENERATION.load(Ordering::Relaxed);
        if let Some((g, k)) = map.read().unwrap().get(&(*spec, device)) {
            if *g == generation {
                cache::STATS.memory_hits.fetch_add(1, Ordering::Relaxed);
                return Ok(k);
            }
        }
        let obtained = obtain(spec)?;
        let kernel: &'static Kernel = Box::leak(Box::new(load(&obtained.compiled, device, spec)?));
        map.write()
            .unwrap()
            .insert((*spec, device), (generation, kernel));
        Ok(kernel)
    }
}

impl<K: KernelSpec> Default for KernelMap<K> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A spec for the test kernel of nvrtc.rs (not in kernels/).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    struct TestSpec {
        n: u32,
        arch: Arch,
    }

    impl KernelSpec for TestSpec {
        fn kernel(&self) -> &'static str {
            "fa_test::scale"
        }
        fn header(&self) -> &'static str {
            "<test>"
        }
        fn name_expression(&self) -> String {
            format!("fa_test::scale<{}, __half>", self.n)
        }
        fn arch(&self) -> Arch {
            self.arch
        }
        fn dynamic_smem_bytes(&self) -> u32 {
            0
        }
        fn program(&self) -> String {
            nvrtc::tests::TEST_KERNEL.to_string()
        }
    }

    #[test]
    fn cache_key_is_stable_and_discriminating() {
        let a = TestSpec {
            n: 64,
            arch: Arch::Sm80,
        };
        let opts = vec![
            "--gpu-architecture=sm_80".to_string(),
            "-std=c++17".to_string(),
        ];
        let k = cache_key(&a, &opts, (13, 0));
        assert_eq!(k, cache_key(&a, &opts, (13, 0)));
        assert!(
            k.contains("name=fa_test::scale<64, __half>")
                && k.contains("nvrtc=13.0")
                && k.contains("arch=sm_80")
        );
        assert_ne!(k, cache_key(&TestSpec { n: 32, ..a }, &opts, (13, 0)));
        assert_ne!(
            k,
            cache_key(
                &TestSpec {
                    arch: Arch::Sm90a,
                    ..a
                },
                &opts,
                (13, 0)
            )
        );
        assert_ne!(k, cache_key(&a, &opts, (13, 2)));
        assert_ne!(k, cache_key(&a, &opts[..1], (13, 0)));
        assert!(k.contains(&format!("sources={}", sources_digest())));
    }

    #[test]
    fn disk_cache_miss_hit_and_corrupt_rebuild() {
        let Some(arch) = nvrtc::tests::toolchain() else {
            return;
        };
        let dir =
            std::env::temp_dir().join(format!("ferroattn-obtain-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let spec = TestSpec { n: 16, arch };
        let first = obtain_in(&dir, &spec).unwrap();
        assert!(!first.from_cache && first.compile_seconds > 0.0);
        let second = obtain_in(&dir, &spec).unwrap();
        assert!(second.from_cache);
        assert!(
            second.compiled.cubin == first.compiled.cubin,
            "same CUBIN from disk"
        );
        assert_eq!(second.compiled.lowered_name, first.compiled.lowered_name);
        assert_eq!(
            second.compiled.log, first.compiled.log,
            "the log is stored with the CUBIN"
        );
        // corrupt the one file: it is rebuilt, never loaded
        let file = walk(&dir).pop().unwrap();
        let mut bytes = std::fs::read(&file).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&file, &bytes).unwrap();
        let before = cache::STATS.corrupt_rebuilt.load(Ordering::Relaxed);
        let third = obtain_in(&dir, &spec).unwrap();
        assert!(!third.from_cache);
        assert!(third.compiled.cubin == first.compiled.cubin);
        assert!(cache::STATS.corrupt_rebuilt.load(Ordering::Relaxed) > before);
        assert!(
            obtain_in(&dir, &spec).unwrap().from_cache,
            "rebuilt file is valid again"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            if e.path().is_dir() {
                out.extend(walk(&e.path()));
            } else {
                out.push(e.path());
            }
        }
        out
    }

    #[test]
    fn short_names_drop_the_namespace() {
        assert_eq!(short_name("ferroattn::attn_fwd_sm80"), "attn_fwd_sm80");
        assert_eq!(short_name("a::b::attn_bwd_dq_sm80"), "attn_bwd_dq_sm80");
        assert_eq!(short_name("plain"), "plain");
    }
}
