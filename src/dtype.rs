//! Element types that cross the boundary: names (as in `_native.pyi`), DLPack codes,
//! sizes and the CUDA C++ type a kernel template is instantiated with.

use dlpark::ffi::{DLDataType, DLDataTypeCode};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F16,
    BF16,
    F32,
    F64,
    I32,
    I64,
    /// Only for 2:4 metadata (src/ops/sparse24).
    I16,
    U8,
    I8,
    Bool,
}

impl DType {
    pub const ALL: [DType; 10] = [
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
        DType::I32,
        DType::I64,
        DType::I16,
        DType::U8,
        DType::I8,
        DType::Bool,
    ];

    /// The name used in Python (`TensorMeta`, `Buffer.dtype`): "float16", "bfloat16", ...
    pub fn name(self) -> &'static str {
        match self {
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::I16 => "int16",
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::Bool => "bool",
        }
    }

    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == name)
    }

    /// "one of float16, bfloat16, ...": the expected-value text of dtype errors.
    pub fn one_of() -> String {
        format!("one of {}", DType::ALL.map(|d| d.name()).join(", "))
    }

    /// `from_name`, or a DType error naming `arg`.
    pub fn parse(arg: &str, name: &str) -> crate::Result<DType> {
        DType::from_name(name)
            .ok_or_else(|| crate::Error::dtype(arg, DType::one_of(), format!("{name:?}")))
    }

    /// (code, bits, lanes) as DLPack (and torch) encode it.
    pub fn dl_triple(self) -> (u8, u8, u16) {
        match self {
            DType::F16 => (2, 16, 1),
            DType::BF16 => (4, 16, 1),
            DType::F32 => (2, 32, 1),
            DType::F64 => (2, 64, 1),
            DType::I32 => (0, 32, 1),
            DType::I64 => (0, 64, 1),
            DType::I16 => (0, 16, 1),
            DType::U8 => (1, 8, 1),
            DType::I8 => (0, 8, 1),
            DType::Bool => (6, 8, 1),
        }
    }

    pub fn from_dl_triple(triple: (u8, u8, u16)) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.dl_triple() == triple)
    }

    pub fn to_dl(self) -> DLDataType {
        let (code, bits, lanes) = self.dl_triple();
        DLDataType {
            code: DLDataTypeCode(code),
            bits,
            lanes,
        }
    }

    pub fn from_dl(dt: DLDataType) -> Option<DType> {
        DType::from_dl_triple((dt.code.0, dt.bits, dt.lanes))
    }

    pub fn size_bytes(self) -> usize {
        self.dl_triple().1 as usize / 8
    }

    /// The CUDA C++ element type kernels are instantiated with.
    pub fn cuda_type(self) -> &'static str {
        match self {
            DType::F16 => "__half",
            DType::BF16 => "__nv_bfloat16",
            DType::F32 => "float",
            DType::F64 => "double",
            DType::I32 => "int",
            DType::I64 => "long long",
            DType::I16 => "short",
            DType::U8 => "unsigned char",
            DType::I8 => "signed char",
            DType::Bool => "bool",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dlpack_codes_match_torch() {
        // api-contracts §2.3: the triples torch 2.11 exports.
        assert_eq!(DType::BF16.dl_triple(), (4, 16, 1));
        assert_eq!(DType::F16.dl_triple(), (2, 16, 1));
        assert_eq!(DType::F32.dl_triple(), (2, 32, 1));
        assert_eq!(DType::I32.dl_triple(), (0, 32, 1));
        assert_eq!(DType::I64.dl_triple(), (0, 64, 1));
        assert_eq!(DType::I16.dl_triple(), (0, 16, 1));
        assert_eq!(DType::U8.dl_triple(), (1, 8, 1));
        assert_eq!(DType::I8.dl_triple(), (0, 8, 1));
        assert_eq!(DType::Bool.dl_triple(), (6, 8, 1));
    }

    #[test]
    fn names_and_codes_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_name(d.name()), Some(d));
            assert_eq!(DType::from_dl(d.to_dl()), Some(d));
            assert_eq!(d.size_bytes() * 8, d.dl_triple().1 as usize);
        }
        assert_eq!(DType::from_name("half"), None);
        assert_eq!(DType::from_dl_triple((10, 8, 1)), None); // float8_e4m3fn: not supported
        assert_eq!(DType::from_dl_triple((2, 16, 2)), None); // vector lanes
    }

    #[test]
    fn cuda_types() {
        assert_eq!(DType::F16.cuda_type(), "__half");
        assert_eq!(DType::BF16.cuda_type(), "__nv_bfloat16");
    }
}
