//! Where the CUDA headers the kernels include (cuda_fp16.h, cuda_bf16.h, crt/…) live:
//! `$CUDA_HOME/include`, `/usr/local/cuda/include`, then the directories given by
//! `configure` (ferroattn._env passes site-packages `nvidia/cu13/include`).

use crate::error::{Error, Result};
use std::path::PathBuf;
use std::sync::RwLock;

static CONFIGURED: RwLock<Vec<PathBuf>> = RwLock::new(Vec::new());

/// Set the extra include directories searched after the standard ones.
pub fn configure(dirs: Vec<PathBuf>) {
    *CONFIGURED.write().unwrap() = dirs;
}

/// Every directory searched, in order.
pub fn candidates() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(home) = std::env::var_os("CUDA_HOME").filter(|h| !h.is_empty()) {
        dirs.push(PathBuf::from(home).join("include"));
    }
    dirs.push(PathBuf::from("/usr/local/cuda/include"));
    dirs.extend(CONFIGURED.read().unwrap().iter().cloned());
    dirs
}

/// The first candidate holding cuda_fp16.h.
pub fn header_dir() -> Result<PathBuf> {
    let dirs = candidates();
    dirs.iter()
        .find(|d| d.join("cuda_fp16.h").is_file())
        .cloned()
        .ok_or_else(|| Error::HeadersNotFound {
            searched: dirs
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        })
}
