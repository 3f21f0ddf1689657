//! The on-disk kernel cache and the process's JIT counters.
//!
//! A CUBIN lives at `<cache_dir>/<nvrtc major.minor>/<arch>/<hash>.cubin`, `hash` over
//! (every embedded kernel source, the program source, the options, the name expression,
//! the NVRTC version, the arch). The file is written atomically (temp file + rename) and
//! carries a header with its payload length and checksum plus the full key, so a torn,
//! corrupt or colliding file is detected, deleted and rebuilt, never loaded.
//!
//! File layout (little endian): magic `FACUBIN1` | u64 payload length | u64 FNV-1a of the
//! payload | payload = [u32 len | key] [u32 len | lowered name] [u32 len | log] [cubin…].

use super::nvrtc::Compiled;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

const MAGIC: &[u8; 8] = b"FACUBIN1";

/// `$FERROATTN_CACHE_DIR`, else `~/.cache/ferroattn` (else a temp dir without HOME).
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("FERROATTN_CACHE_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    match std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        Some(home) => PathBuf::from(home).join(".cache").join("ferroattn"),
        None => std::env::temp_dir().join("ferroattn-cache"),
    }
}

/// 64-bit FNV-1a, seeded: stable across processes, platforms and Rust versions.
fn fnv1a(seed: u64, parts: &[&[u8]]) -> u64 {
    let mut h = seed;
    for part in parts {
        for &b in *part {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // separator, so ("ab","c") and ("a","bc") differ
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// Hex digest (128 bits, two independently seeded FNV-1a) of a cache key text.
pub fn digest(key: &str) -> String {
    let a = fnv1a(FNV_OFFSET, &[key.as_bytes()]);
    let b = fnv1a(FNV_OFFSET ^ 0x9e37_79b9_7f4a_7c15, &[key.as_bytes()]);
    format!("{a:016x}{b:016x}")
}

/// Where the CUBIN for `key` lives.
pub fn path_for(dir: &Path, nvrtc: (i32, i32), arch: &str, key: &str) -> PathBuf {
    dir.join(format!("{}.{}", nvrtc.0, nvrtc.1))
        .join(arch)
        .join(format!("{}.cubin", digest(key)))
}

fn push_field(buf: &mut Vec<u8>, field: &[u8]) {
    buf.extend_from_slice(&(field.len() as u32).to_le_bytes());
    buf.extend_from_slice(field);
}

pub fn encode(key: &str, c: &Compiled) -> Vec<u8> {
    let mut payload = Vec::with_capacity(c.cubin.len() + key.len() + c.log.len() + 64);
    push_field(&mut payload, key.as_bytes());
    push_field(&mut payload, c.lowered_name.as_bytes());
    push_field(&mut payload, c.log.as_bytes());
    payload.extend_from_slice(&c.cubin);
    let mut out = Vec::with_capacity(payload.len() + 24);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&fnv1a(FNV_OFFSET, &[&payload]).to_le_bytes());
    out.extend_from_slice(&payload);
    out
}

/// Why a cache file was rejected.
#[derive(Debug, PartialEq, Eq)]
pub enum Corrupt {
    Magic,
    Length,
    Checksum,
    Fields,
    KeyMismatch,
}

pub fn decode(bytes: &[u8], key: &str) -> Result<Compiled, Corrupt> {
    if bytes.len() < 24 || &bytes[..8] != MAGIC {
        return Err(Corrupt::Magic);
    }
    let len = u64::from_le_bytes(bytes[8..16].try_into().unwrap());
    let sum = u64::from_le_bytes(bytes[16..24].try_into().unwrap());
    let payload = &bytes[24..];
    if payload.len() as u64 != len {
        return Err(Corrupt::Length);
    }
    if fnv1a(FNV_OFFSET, &[payload]) != sum {
        return Err(Corrupt::Checksum);
    }
    let mut rest = payload;
    let mut field = || -> Result<String, Corrupt> {
        if rest.len() < 4 {
            return Err(Corrupt::Fields);
        }
        let n = u32::from_le_bytes(rest[..4].try_into().unwrap()) as usize;
        if rest.len() < 4 + n {
            return Err(Corrupt::Fields);
        }
        let s = String::from_utf8(rest[4..4 + n].to_vec()).map_err(|_| Corrupt::Fields)?;
        rest = &rest[4 + n..];
        Ok(s)
    };
    let stored_key = field()?;
    let lowered_name = field()?;
    let log = field()?;
    if stored_key != key {
        return Err(Corrupt::KeyMismatch);
    }
    if rest.is_empty() {
        return Err(Corrupt::Fields);
    }
    Ok(Compiled {
        cubin: rest.to_vec(),
        lowered_name,
        log,
    })
}

/// What reading the cache gave.
pub enum Lookup {
    Hit(Compiled),
    Miss,
    /// A file was there but unusable; it has been deleted.
    Corrupt(Corrupt),
}

pub fn read(path: &Path, key: &str) -> Lookup {
    let Ok(bytes) = std::fs::read(path) else {
        return Lookup::Miss;
    };
    match decode(&bytes, key) {
        Ok(c) => Lookup::Hit(c),
        Err(why) => {
            let _ = std::fs::remove_file(path);
            Lookup::Corrupt(why)
        }
    }
}

/// Write atomically: a unique temp file in the same directory, then rename over `path`.
/// Failures (read-only home, full disk) are returned for the caller to ignore.
pub fn write(path: &Path, key: &str, c: &Compiled) -> std::io::Result<()> {
    use std::io::Write;
    let dir = path.parent().expect("cache path has a parent");
    std::fs::create_dir_all(dir)?;
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let tmp = dir.join(format!(
        ".{}.tmp.{}.{}",
        path.file_name().unwrap().to_string_lossy(),
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&encode(key, c))?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Counters of this process (`jit_stats()`); seconds are kept as nanoseconds.
#[derive(Default)]
pub struct Stats {
    pub compiles: AtomicU64,
    pub compile_nanos: AtomicU64,
    pub disk_hits: AtomicU64,
    pub disk_load_nanos: AtomicU64,
    pub module_loads: AtomicU64,
    pub module_load_nanos: AtomicU64,
    pub memory_hits: AtomicU64,
    pub corrupt_rebuilt: AtomicU64,
}

pub static STATS: Stats = Stats {
    compiles: AtomicU64::new(0),
    compile_nanos: AtomicU64::new(0),
    disk_hits: AtomicU64::new(0),
    disk_load_nanos: AtomicU64::new(0),
    module_loads: AtomicU64::new(0),
    module_load_nanos: AtomicU64::new(0),
    memory_hits: AtomicU64::new(0),
    corrupt_rebuilt: AtomicU64::new(0),
};

pub fn add_seconds(counter: &AtomicU64, since: std::time::Instant) -> f64 {
    let d = since.elapsed();
    counter.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    d.as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Compiled {
        Compiled {
            cubin: b"\x7fELFcubin-bytes".to_vec(),
            lowered_name: "_Z1kv".into(),
            log: "ptxas info".into(),
        }
    }

    #[test]
    fn digest_is_stable() {
        // A fixed value: the disk cache of one build must be found by the next.
        assert_eq!(digest("ferroattn"), digest("ferroattn"));
        assert_eq!(digest("ferroattn"), "3cb525a8ab051e8bdbd9610afa04b2e2");
        assert_eq!(fnv1a(FNV_OFFSET, &[]), FNV_OFFSET);
        assert_ne!(digest("a|b"), digest("a|c"));
        assert_eq!(digest("abc").len(), 32);
    }

    #[test]
    fn round_trip_and_corruption_detected() {
        let c = sample();
        let bytes = encode("key", &c);
        assert_eq!(decode(&bytes, "key").unwrap(), c);
        assert_eq!(decode(&bytes, "other").unwrap_err(), Corrupt::KeyMismatch);
        // torn: every truncation is rejected
        for n in 0..bytes.len() {
            assert!(
                decode(&bytes[..n], "key").is_err(),
                "truncated at {n} accepted"
            );
        }
        // any flipped byte is rejected
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x5a;
            assert!(decode(&b, "key").is_err(), "flip at {i} accepted");
        }
    }

    #[test]
    fn write_is_atomic_and_corrupt_file_is_removed() {
        let dir = std::env::temp_dir().join(format!("ferroattn-cache-test-{}", std::process::id()));
        let path = path_for(&dir, (13, 0), "sm_80", "key");
        assert!(path.ends_with(format!("13.0/sm_80/{}.cubin", digest("key"))));
        write(&path, "key", &sample()).unwrap();
        assert!(matches!(read(&path, "key"), Lookup::Hit(c) if c == sample()));
        // no temp files left behind
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        // tear the file: it is detected, deleted, and the next read is a miss
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
        assert!(matches!(
            read(&path, "key"),
            Lookup::Corrupt(Corrupt::Length)
        ));
        assert!(!path.exists());
        assert!(matches!(read(&path, "key"), Lookup::Miss));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
