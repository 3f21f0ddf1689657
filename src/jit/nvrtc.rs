//! NVRTC: load the library, compile one program to CUBIN through cudarc's low-level API
//! (`nvrtc::result` + `nvrtcGetCUBIN`; never the safe `compile_ptx`, which returns PTX and
//! truncates logs), instantiate one template through a name expression, and return the
//! CUBIN, the lowered (mangled) name and the whole log (NULs replaced by newlines).

use super::{headers, sources};
use crate::arch::Arch;
use crate::error::{Error, Result};
use cudarc::nvrtc::{result as nv, sys};
use std::ffi::{c_char, CStr, CString};
use std::path::PathBuf;
use std::sync::OnceLock;

/// The output of one successful compilation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub lowered_name: String,
    pub log: String,
}

fn present() -> bool {
    // SAFETY: a pure probe (dlopen of candidate names); never panics.
    unsafe { sys::is_culib_present() }
}

/// Directories a pip-installed libnvrtc may sit in: `<include>/../lib` for each header
/// candidate (site-packages nvidia/cu13/lib, $CUDA_HOME/lib64, …).
fn lib_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for inc in headers::candidates() {
        if let Some(parent) = inc.parent() {
            dirs.push(parent.join("lib"));
            dirs.push(parent.join("lib64"));
        }
    }
    dirs
}

/// Preload libnvrtc-builtins and libnvrtc from `dir` with RTLD_GLOBAL, so that cudarc's
/// later dlopen("libnvrtc.so.13") resolves to it by soname (toolchain.md §2).
fn preload_from(dir: &std::path::Path) -> bool {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    let nvrtc = dir.join("libnvrtc.so.13");
    if !nvrtc.is_file() {
        return false;
    }
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("libnvrtc-builtins.so.") {
                // SAFETY: loading NVIDIA's library runs no initialisers we depend on.
                if let Ok(lib) = unsafe { Library::open(Some(e.path()), RTLD_NOW | RTLD_GLOBAL) } {
                    std::mem::forget(lib);
                }
            }
        }
    }
    // SAFETY: as above; kept loaded for the life of the process.
    match unsafe { Library::open(Some(&nvrtc), RTLD_NOW | RTLD_GLOBAL) } {
        Ok(lib) => {
            std::mem::forget(lib);
            true
        }
        Err(_) => false,
    }
}

/// Make sure NVRTC can be called (NvrtcNotFound otherwise). Success is remembered.
pub fn ensure_loaded() -> Result<()> {
    static LOADED: OnceLock<()> = OnceLock::new();
    if LOADED.get().is_some() {
        return Ok(());
    }
    if !present() {
        let dirs = lib_dirs();
        for d in &dirs {
            if preload_from(d) && present() {
                break;
            }
        }
        if !present() {
            return Err(Error::NvrtcNotFound {
                searched: dirs
                    .iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
    }
    let _ = LOADED.set(());
    Ok(())
}

/// (major, minor) of the NVRTC library, loading it if needed.
pub fn version() -> Result<(i32, i32)> {
    ensure_loaded()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two ints.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| compile_error("nvrtcVersion", "-", format!("{e:?}"), String::new()))?;
    Ok((major, minor))
}

/// The compiler options for `arch` (the header dir is part of them, hence of the cache key).
pub fn options(arch: Arch) -> Result<Vec<String>> {
    let inc = headers::header_dir()?;
    let mut opts = vec![
        format!("--gpu-architecture={}", arch.name()),
        "-std=c++17".to_string(),
        format!("-I{}", inc.display()),
        "--ptxas-options=-v".to_string(),
    ];
    if crate::env_switch::env_switch("FERROATTN_LINEINFO", false)? {
        opts.push("-lineinfo".to_string());
    }
    Ok(opts)
}

fn compile_error(name: &str, arch: &str, reason: String, log: String) -> Error {
    Error::Compile {
        name: name.to_string(),
        arch: arch.to_string(),
        reason,
        log,
    }
}

/// NVRTC's log bytes → text: embedded NULs (between ptxas messages) become newlines.
pub fn clean_log(raw: &[u8]) -> String {
    let bytes: Vec<u8> = raw
        .iter()
        .map(|&b| if b == 0 { b'\n' } else { b })
        .collect();
    String::from_utf8_lossy(&bytes).trim_end().to_string()
}

/// Destroys the program on every path out of `compile`.
struct Program(sys::nvrtcProgram);
impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram, destroyed once.
        let _ = unsafe { nv::destroy_program(self.0) };
    }
}

/// Headers handed to every program: all of kernels/, named by relative path.
fn embedded_headers() -> &'static (Vec<CString>, Vec<CString>) {
    static H: OnceLock<(Vec<CString>, Vec<CString>)> = OnceLock::new();
    H.get_or_init(|| {
        let names = sources::SOURCES
            .iter()
            .map(|(p, _)| CString::new(*p).unwrap())
            .collect();
        let texts = sources::SOURCES
            .iter()
            .map(|(_, s)| CString::new(*s).expect("NUL in kernel source"))
            .collect();
        (names, texts)
    })
}

/// Compile `source` (which includes kernel headers by relative path) and instantiate
/// `name_expression`. `arch_name` is only used in error messages.
pub fn compile(
    source: &str,
    name_expression: &str,
    opts: &[String],
    arch_name: &str,
) -> Result<Compiled> {
    ensure_loaded()?;
    let err = |reason: String, log: String| compile_error(name_expression, arch_name, reason, log);
    let src = CString::new(source).map_err(|e| err(e.to_string(), String::new()))?;
    let name_expr = CString::new(name_expression).map_err(|e| err(e.to_string(), String::new()))?;
    let (names, texts) = embedded_headers();
    let name_ptrs: Vec<*const c_char> = names.iter().map(|c| c.as_ptr()).collect();
    let text_ptrs: Vec<*const c_char> = texts.iter().map(|c| c.as_ptr()).collect();

    let mut raw: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer outlives the program (owned above or 'static).
    unsafe {
        sys::nvrtcCreateProgram(
            &mut raw,
            src.as_ptr(),
            c"ferroattn.cu".as_ptr(),
            text_ptrs.len() as i32,
            text_ptrs.as_ptr(),
            name_ptrs.as_ptr(),
        )
    }
    .result()
    .map_err(|e| err(format!("nvrtcCreateProgram: {e:?}"), String::new()))?;
    let prog = Program(raw);
    // SAFETY: valid program and C string.
    unsafe { sys::nvrtcAddNameExpression(prog.0, name_expr.as_ptr()) }
        .result()
        .map_err(|e| err(format!("nvrtcAddNameExpression: {e:?}"), String::new()))?;

    // SAFETY: valid program.
    let status = unsafe { nv::compile_program(prog.0, opts) };
    // SAFETY: valid program.
    let log = unsafe { nv::get_program_log(prog.0) }
        .map(|l| clean_log(&l.iter().map(|&c| c as u8).collect::<Vec<u8>>()))
        .unwrap_or_default();
    if let Err(e) = status {
        return Err(err(format!("{e:?}"), log));
    }

    let mut lowered: *const c_char = std::ptr::null();
    // SAFETY: valid program; the string is owned by it and copied before it is destroyed.
    unsafe { sys::nvrtcGetLoweredName(prog.0, name_expr.as_ptr(), &mut lowered) }
        .result()
        .map_err(|e| err(format!("nvrtcGetLoweredName: {e:?}"), log.clone()))?;
    // SAFETY: NVRTC returns a NUL-terminated string.
    let lowered_name = unsafe { CStr::from_ptr(lowered) }
        .to_string_lossy()
        .into_owned();

    let mut size = 0usize;
    // SAFETY: valid program.
    unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }
        .result()
        .map_err(|e| err(format!("nvrtcGetCUBINSize: {e:?}"), log.clone()))?;
    if size == 0 {
        return Err(err(
            "no CUBIN produced (virtual architecture?)".to_string(),
            log,
        ));
    }
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` has `size` bytes.
    unsafe { sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr() as *mut c_char) }
        .result()
        .map_err(|e| err(format!("nvrtcGetCUBIN: {e:?}"), log.clone()))?;
    Ok(Compiled {
        cubin,
        lowered_name,
        log,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A small template kernel of our own (not in kernels/), to develop against.
    pub const TEST_KERNEL: &str = r#"
#include <cuda_fp16.h>
#include "attention/params.cuh"
namespace fa_test {
template <int N, typename T>
__global__ void scale(AttnFwdParams p) {
    __shared__ float buf[N];
    int i = threadIdx.x;
    buf[i % N] = p.softmax_scale * i;
    __syncthreads();
    T* o = reinterpret_cast<T*>(p.o);
    if (i < p.head_dim) o[i] = T(buf[(i + 1) % N]);
}
}
"#;

    /// NVRTC + headers available here? Tests that need them are skipped (with a note) otherwise.
    pub fn toolchain() -> Option<Arch> {
        if let Some(venv) = std::env::var_os("FERROATTN_TEST_CUDA_INCLUDE") {
            headers::configure(vec![PathBuf::from(venv)]);
        }
        match (ensure_loaded(), headers::header_dir()) {
            (Ok(()), Ok(_)) => Some(Arch::Sm80),
            (a, b) => {
                eprintln!(
                    "NVRTC test skipped: nvrtc={:?} headers={:?}",
                    a.err(),
                    b.err()
                );
                None
            }
        }
    }

    /// Compile one specialisation for `arch` and print ptxas's report (registers, spills, wgmma
    /// serialisation warnings) with the compile time; panics on a compile error. For the ignored
    /// `*_compiles` tests that kernel work runs by hand.
    pub fn print_compile<K: crate::jit::KernelSpec>(spec: &K, arch: Arch) {
        let opts = options(arch).unwrap();
        let t = std::time::Instant::now();
        match compile(&spec.program(), &spec.name_expression(), &opts, arch.name()) {
            Ok(o) => {
                eprintln!("{} ({:.1} s)\n{}", spec.name_expression(), t.elapsed().as_secs_f64(), o.log);
                // FERROATTN_TEST_DUMP_CUBIN=<dir>: keep the cubin for nvdisasm / cuobjdump.
                if let Ok(dir) = std::env::var("FERROATTN_TEST_DUMP_CUBIN") {
                    let path = std::path::Path::new(&dir).join(format!("{}.cubin", o.lowered_name));
                    std::fs::write(&path, &o.cubin).unwrap();
                    eprintln!("cubin: {}", path.display());
                }
            }
            Err(e) => panic!("{e}"),
        }
    }

    /// Precompile `specs`, print each one's registers and spills, and assert that none spills.
    pub fn assert_compile_without_spills<K: crate::jit::KernelSpec>(specs: &[K]) {
        let reports = crate::jit::precompile::precompile(specs).unwrap();
        for r in &reports {
            eprintln!("{} regs {} spills {}/{}", r.config, r.resources.registers, r.resources.spill_stores, r.resources.spill_loads);
        }
        crate::jit::precompile::check_spills(&reports).unwrap();
        assert_eq!(reports.len(), specs.len());
    }

    #[test]
    fn log_nuls_become_newlines() {
        assert_eq!(clean_log(b"a\0b\0\0"), "a\nb");
    }

    #[test]
    fn compiles_template_to_cubin_with_lowered_name() {
        let Some(arch) = toolchain() else { return };
        for arch in [arch, Arch::Sm90a] {
            let out = compile(
                TEST_KERNEL,
                "fa_test::scale<64, __half>",
                &options(arch).unwrap(),
                arch.name(),
            )
            .unwrap();
            assert_eq!(&out.cubin[..4], b"\x7fELF");
            assert!(
                out.lowered_name
                    .starts_with("_ZN7fa_test5scaleILi64E6__halfEEv"),
                "{}",
                out.lowered_name
            );
            assert!(
                out.log.contains("Used"),
                "ptxas -v output expected in the log: {}",
                out.log
            );
        }
    }

    #[test]
    fn compile_error_carries_whole_log() {
        let Some(arch) = toolchain() else { return };
        let src = "__global__ void k() { int x = ; }\n__global__ void j() { undefined_fn(); }\n";
        let e = compile(src, "k", &options(arch).unwrap(), arch.name()).unwrap_err();
        let Error::Compile { log, .. } = e else {
            panic!("{e}")
        };
        assert!(log.contains("expected an expression"), "{log}");
        assert!(
            log.contains("undefined_fn"),
            "second error must not be cut off: {log}"
        );
    }
}
