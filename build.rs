//! Embeds every file under kernels/ into the crate: writes $OUT_DIR/kernel_sources.rs,
//! a list of (path relative to kernels/, include_str!(absolute path)). src/jit/sources.rs
//! includes it, so a new kernel file needs no Rust change.

use std::path::{Path, PathBuf};

fn collect(dir: &Path, root: &Path, out: &mut Vec<(String, PathBuf)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect(&path, root, out);
        } else if matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("cuh" | "cu" | "h")
        ) {
            let rel = path
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            out.push((rel, path.canonicalize().unwrap()));
        }
    }
}

fn main() {
    // read at run time: `env!` would freeze the directory the build script was first compiled in,
    // and cargo reuses that binary for another checkout sharing the target dir, which then
    // embedded the other checkout's kernels
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let root = PathBuf::from(manifest_dir).join("kernels");
    println!("cargo:rerun-if-changed=kernels");
    let mut files = Vec::new();
    collect(&root, &root, &mut files);
    files.sort();
    let mut text = String::from("pub static SOURCES: &[(&str, &str)] = &[\n");
    for (rel, abs) in &files {
        text.push_str(&format!(
            "    ({rel:?}, include_str!({:?})),\n",
            abs.to_string_lossy()
        ));
    }
    text.push_str("];\n");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("kernel_sources.rs");
    std::fs::write(out, text).unwrap();
}
