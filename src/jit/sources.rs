//! Every file under kernels/ (.cuh/.cu/.h), embedded at build time (build.rs) and handed
//! to NVRTC as headers named by their path relative to kernels/ ("attention/params.cuh").

include!(concat!(env!("OUT_DIR"), "/kernel_sources.rs"));

/// The embedded text of `path` (relative to kernels/).
pub fn get(path: &str) -> Option<&'static str> {
    SOURCES.iter().find(|(p, _)| *p == path).map(|(_, s)| *s)
}

#[cfg(test)]
mod tests {
    #[test]
    fn params_header_is_embedded() {
        let text =
            super::get("attention/params.cuh").expect("kernels/attention/params.cuh embedded");
        assert!(text.contains("struct AttnFwdParams"));
        assert!(super::SOURCES
            .iter()
            .all(|(p, _)| !p.starts_with('/') && !p.contains('\\')));
    }
}
