//! The validated dense GEMM problem every GEMM backend receives (wmma.rs, sm90.rs):
//!
//!   out[i] = act(alpha · a[i] @ b[i] + beta · c[i] + bias)      for i in 0..batch
//!
//! (cuBLASLt epilogue order: scale, add C, add bias, activate; fp32 accumulation and epilogue,
//! rounded once to out's dtype; `aux`, when present, receives the pre-activation value.)
//!
//! Built only by `ops::gemm::problem` (src/ops/gemm/mod.rs), which guarantees:
//! - a is (m, k), b is (k, n), out / c / aux are (m, n) per batch; m, n, k, batch >= 1;
//! - every operand has `col_stride == 1` (row-major) or `row_stride == 1` (column-major);
//!   out, c and aux are row-major; for a dim of size 1 the stride that does not matter is
//!   normalised (see [`Operand::normalised`]), so exactly the listed invariants hold;
//! - strides are >= 0; `batch_stride` is 0 when batch == 1 or the operand is broadcast;
//! - a and b have the same dtype (fp16 or bf16); c and aux have out's dtype; bias is (n,),
//!   contiguous, a's dtype or fp32;
//! - non-NULL pointers, all on `device`; out/aux overlap no input and not each other.
//!
//! A pure description: the heuristics (`tuning::gemm`, `tuning::gemm_sm90`, `tuning::sparse24`)
//! read it, so it lives here and not in ops (tuning imports nothing from ops).
//!
//! Alignment is *not* guaranteed (any alignment is legal): backends check what they need
//! (e.g. [`Operand::vector_aligned`]).

use crate::dtype::DType;
use crate::error::{Error, Result};

/// The epilogue activation. Discriminants are the codes of kernels/common/activation.cuh
/// (`ActivationKind`); the two must agree (tested in src/ops/gemm/mod.rs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(i32)]
pub enum Activation {
    None = 0,
    Relu = 1,
    GeluTanh = 2,
    GeluErf = 3,
    Silu = 4,
}

impl Activation {
    pub const ALL: [Activation; 5] = [
        Activation::None,
        Activation::Relu,
        Activation::GeluTanh,
        Activation::GeluErf,
        Activation::Silu,
    ];

    /// The template argument of the kernels (kernels/common/activation.cuh `ActivationKind`).
    pub fn code(self) -> i32 {
        self as i32
    }

    /// The name used by `_native.gemm` ("none", "relu", "gelu_tanh", "gelu_erf", "silu").
    pub fn name(self) -> &'static str {
        match self {
            Activation::None => "none",
            Activation::Relu => "relu",
            Activation::GeluTanh => "gelu_tanh",
            Activation::GeluErf => "gelu_erf",
            Activation::Silu => "silu",
        }
    }

    /// Parse a name; an unknown one is an ArgumentError naming `arg`.
    pub fn parse(arg: &str, name: &str) -> Result<Activation> {
        Activation::ALL
            .into_iter()
            .find(|a| a.name() == name)
            .ok_or_else(|| {
                Error::argument(
                    arg,
                    format!("one of {}", Activation::ALL.map(|a| a.name()).join(", ")),
                    format!("{name:?}"),
                )
            })
    }
}

impl std::fmt::Display for Activation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One matrix operand per batch entry: element (i, j) of batch entry z lives at
/// `ptr + (z·batch_stride + i·row_stride + j·col_stride) · dtype.size_bytes()`.
/// Strides in elements; one of `row_stride` / `col_stride` is 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Operand {
    pub ptr: u64,
    pub rows: i64,
    pub cols: i64,
    pub row_stride: i64,
    pub col_stride: i64,
    pub batch_stride: i64,
    pub dtype: DType,
}

impl Operand {
    /// True when rows are contiguous (`col_stride == 1`); false: column-major (`row_stride == 1`).
    pub fn row_major(&self) -> bool {
        self.col_stride == 1
    }

    /// The stride between consecutive rows (row-major) or columns (column-major): the BLAS `ld`.
    pub fn leading_dim(&self) -> i64 {
        if self.row_major() {
            self.row_stride
        } else {
            self.col_stride
        }
    }

    /// This operand with the strides of size-1 dims made canonical: a size-1 dim may have any
    /// stride, so (a) a matrix that is row-major by its strides or has one column is stored as
    /// row-major (`col_stride = 1`), else as column-major (`row_stride = 1`); (b) the leading
    /// dim of a single row (row-major) / column (column-major) is set to the dense value
    /// (cols / rows), so it never spoils alignment; (c) `batch_stride` is 0 when `batch == 1`.
    /// None when neither layout fits (no unit stride on a dim of size > 1).
    pub fn normalised(mut self, batch: i64) -> Option<Operand> {
        if self.col_stride == 1 || self.cols == 1 {
            self.col_stride = 1;
            if self.rows == 1 {
                self.row_stride = self.cols;
            }
        } else if self.row_stride == 1 || self.rows == 1 {
            self.row_stride = 1;
            if self.cols == 1 {
                self.col_stride = self.rows;
            }
        } else {
            return None;
        }
        if batch == 1 {
            self.batch_stride = 0;
        }
        Some(self)
    }

    /// Whether `vec_elems`-element vectors (e.g. 8 fp16 = 16 bytes) along the contiguous dim
    /// are naturally aligned everywhere and never cross the end of a line: the pointer, the
    /// line length (the contiguous dim's extent), the leading dim (when more than one
    /// row/column is used) and the batch stride (when used) are multiples of the vector.
    pub fn vector_aligned(&self, vec_elems: i64) -> bool {
        let bytes = vec_elems as u64 * self.dtype.size_bytes() as u64;
        let (lines, line_len) = if self.row_major() { (self.rows, self.cols) } else { (self.cols, self.rows) };
        // The line length too: a vector that straddles the end of a line would be a partial
        // cp.async (src-size < cp-size), which compute-sanitizer reports as an out-of-bounds
        // read of the whole vector at the end of an allocation.
        self.ptr.is_multiple_of(bytes)
            && line_len % vec_elems == 0
            && (lines <= 1 || self.leading_dim() % vec_elems == 0)
            && self.batch_stride % vec_elems == 0
    }
}

/// A validated GEMM call (see the module docs for the invariants).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmProblem {
    /// CUDA device ordinal of every tensor.
    pub device: i32,
    pub batch: i64,
    pub m: i64,
    pub n: i64,
    pub k: i64,
    /// (m, k), fp16 or bf16.
    pub a: Operand,
    /// (k, n), a's dtype.
    pub b: Operand,
    /// (m, n), row-major, fp16 / bf16 / fp32; batch stride != 0 unless batch == 1.
    pub out: Operand,
    /// (m, n), out's dtype, row-major; None when beta == 0 (then never read).
    pub c: Option<Operand>,
    /// (n,) contiguous: pointer and dtype (a's dtype or fp32).
    pub bias: Option<(u64, DType)>,
    /// Pre-activation output, like out.
    pub aux: Option<Operand>,
    pub alpha: f32,
    pub beta: f32,
    pub activation: Activation,
}

impl GemmProblem {
    /// a's dtype (= b's): the tensor-core input type.
    pub fn input_dtype(&self) -> DType {
        self.a.dtype
    }

    /// out's dtype (= c's = aux's).
    pub fn out_dtype(&self) -> DType {
        self.out.dtype
    }
}

/// A test problem: row-major a (m, k), b (k, n) of `dtype` and out (m, n) of `out_dtype` at a
/// 16-byte aligned fake address, packed batches (batch stride 0 when batch == 1), no epilogue.
#[cfg(test)]
pub(crate) fn row_major_problem(batch: i64, m: i64, n: i64, k: i64, dtype: DType, out_dtype: DType) -> GemmProblem {
    let op = |rows: i64, cols: i64, dtype: DType| Operand {
        ptr: 0x10000,
        rows,
        cols,
        row_stride: cols,
        col_stride: 1,
        batch_stride: if batch == 1 { 0 } else { rows * cols },
        dtype,
    };
    GemmProblem {
        device: 0,
        batch,
        m,
        n,
        k,
        a: op(m, k, dtype),
        b: op(k, n, dtype),
        out: op(m, n, out_dtype),
        c: None,
        bias: None,
        aux: None,
        alpha: 1.0,
        beta: 0.0,
        activation: Activation::None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(rows: i64, cols: i64, rs: i64, cs: i64) -> Operand {
        Operand {
            ptr: 0x1000,
            rows,
            cols,
            row_stride: rs,
            col_stride: cs,
            batch_stride: 77,
            dtype: DType::F16,
        }
    }

    #[test]
    fn activation_names_round_trip_and_codes_are_the_header_order() {
        for (i, a) in Activation::ALL.into_iter().enumerate() {
            assert_eq!(a.code(), i as i32);
            assert_eq!(Activation::parse("activation", a.name()).unwrap(), a);
        }
        let e = Activation::parse("activation", "gelu").unwrap_err().to_string();
        assert!(e.starts_with("activation: expected one of none, relu"), "{e}");
        assert!(e.contains("\"gelu\""), "{e}");
    }

    #[test]
    fn normalisation_of_size_one_dims() {
        // row-major stays; column-major stays
        let r = op(4, 5, 5, 1).normalised(2).unwrap();
        assert!(r.row_major() && r.leading_dim() == 5 && r.batch_stride == 77);
        let c = op(4, 5, 1, 4).normalised(2).unwrap();
        assert!(!c.row_major() && c.leading_dim() == 4);
        // a single row with a non-unit column stride: column-major (row stride 1)
        let one_row = op(1, 5, 3, 7).normalised(1).unwrap();
        assert_eq!((one_row.row_stride, one_row.col_stride, one_row.batch_stride), (1, 7, 0));
        let one_row_rm = op(1, 5, 3, 1).normalised(1).unwrap();
        assert_eq!((one_row_rm.row_stride, one_row_rm.col_stride), (5, 1));
        // one column: row-major whatever its strides, leading dim untouched
        let one_col = op(6, 1, 9, 4).normalised(3).unwrap();
        assert_eq!((one_col.row_stride, one_col.col_stride), (9, 1));
        // 1x1
        let s = op(1, 1, 0, 0).normalised(1).unwrap();
        assert_eq!((s.row_stride, s.col_stride), (1, 1));
        // neither stride 1
        assert!(op(4, 5, 10, 2).normalised(1).is_none());
    }

    #[test]
    fn vector_alignment() {
        let mut a = op(4, 16, 16, 1);
        a.batch_stride = 64;
        assert!(a.vector_aligned(8));
        a.row_stride = 17; // k = 17 rows
        assert!(!a.vector_aligned(8));
        a.rows = 1; // one row: the leading dim is never used
        assert!(a.vector_aligned(8));
        a.ptr += 2;
        assert!(!a.vector_aligned(8));
        a.ptr -= 2;
        a.batch_stride = 12;
        assert!(!a.vector_aligned(8));
    }
}
