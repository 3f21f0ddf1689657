//! Test helpers shared by the attention op tests (src/ops/attention/tests.rs and
//! src/ops/attention_bwd/tests.rs): tensor metadata,
//! error checks, and the checks that a `#[repr(C)]` params struct mirrors its kernel header.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::{Device, TensorMeta};

/// Contiguous metadata of `shape` on cuda:0.
pub fn t(shape: &[i64], dtype: DType) -> TensorMeta {
    TensorMeta {
        shape: shape.to_vec(),
        strides: TensorMeta::contiguous_strides(shape),
        dtype,
        device: Device::cuda(0),
    }
}

fn kind_of(e: &Error) -> &'static str {
    match e {
        Error::Argument { .. } => "Argument",
        Error::DType { .. } => "DType",
        Error::Device { .. } => "Device",
        Error::NoDevice(_) => "NoDevice",
        _ => "other",
    }
}

/// The error must be of `kind`, and its message name `arg` and contain every `parts`.
pub fn check_err(r: Result<impl std::fmt::Debug>, kind: &str, arg: &str, parts: &[&str]) {
    let e = r.expect_err("expected an error");
    let msg = e.to_string();
    assert_eq!(kind_of(&e), kind, "{msg}");
    assert!(msg.starts_with(&format!("{arg}: ")), "{msg}");
    for p in parts {
        assert!(msg.contains(p), "{msg:?} lacks {p:?}");
    }
}

/// The field names of `struct name` in the embedded kernel header `header`, in declaration order.
pub fn header_fields(header: &str, name: &str) -> Vec<&'static str> {
    let text = crate::jit::sources::get(header).unwrap();
    let start = text.find(&format!("struct {name}")).unwrap();
    let body = &text[start..start + text[start..].find("};").unwrap()];
    body.lines()
        .map(|l| l.split("//").next().unwrap().trim())
        .filter(|l| l.ends_with(';'))
        .flat_map(|l| {
            l.trim_end_matches(';')
                .split(',')
                .map(|f| f.split_whitespace().last().unwrap().trim_start_matches('*'))
        })
        .collect()
}

/// NVRTC (when available) agrees on the size and alignment of `T`, mirrored as `struct name`
/// of `header`. NVRTC has no offsetof: field names/order come from `header_fields`.
pub fn check_layout_with_nvrtc<T>(header: &str, name: &str) {
    let Some(arch) = crate::jit::nvrtc::tests::toolchain() else {
        return;
    };
    let src = format!(
        "#include \"{header}\"\n\
         static_assert(sizeof({name}) == {}, \"size\");\n\
         static_assert(alignof({name}) == {}, \"align\");\n\
         __global__ void probe({name} p) {{}}\n",
        std::mem::size_of::<T>(),
        std::mem::align_of::<T>()
    );
    let opts = crate::jit::nvrtc::options(arch).unwrap();
    crate::jit::nvrtc::compile(&src, "probe", &opts, arch.name()).unwrap();
}
