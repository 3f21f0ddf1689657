//! FLOPs and compulsory bytes of one attention kernel launch: the `flops` / `bytes` the
//! launch recorder (src/profiler/) reports. Pure arithmetic, unit-tested on CPU.
//!
//! FLOPs (DESIGN.md §5; FlashAttention-2 paper §3.3 counts the same way): 2·m·n·k per
//! tensor-core product, summed over the (query, key) pairs of every (batch, query head) that
//! the launch visits and that are not masked, the bottom-right causal mask counted exactly.
//! With head dim d, one product over `pairs` pairs is 2·pairs·d: the forward runs two
//! (S = QKᵀ, O = PV), so 4·pairs·d; the default backward five (S, dP = dO·Vᵀ, dV = PᵀdO,
//! dK = dSᵀQ, dQ = dS·K), so 10·pairs·d = 2.5× the forward. The elementwise kernels
//! (preprocess, dQ conversion) count 0.
//!
//! Bytes: every tensor a launch reads or writes counted once (the least global-memory traffic
//! it can have; K/V tiles re-read per query tile are not counted). dq_accum, reduced into with
//! atomics, counts once. GQA: k, v, dk, dv have heads_k heads.
//!
//! Varlen: the per-sequence lengths live on the device (cu_seqlens), so the pair count
//! assumes every sequence has total/batch tokens (rounded to the nearest integer) and the
//! result is marked inexact; bytes use the real total rows.
//!
//! A call whose batch is split over launches (src/ops/attention/batch.rs) counts each launch
//! with its slice's sizes (`AttnSizes::slice`): the launches' FLOPs add up to the call's.

use super::variant::{visible_pairs, Window};
use super::Problem;
use crate::launch_record::Work;
use crate::tensor::TensorMeta;
use crate::tuning::attention_bwd::BwdKind;

/// Products of the attention forward (S = Q Kᵀ, O = P V) and of its backward (S, dP, dV, dK, dQ;
/// FlashAttention-2 paper §3.2): the counting convention of every attention FLOP figure (the
/// launch records, the ops' FLOP counts, the benchmarks).
pub const ATTN_FWD_PRODUCTS: u64 = 2;
pub const ATTN_BWD_PRODUCTS: u64 = 5;

/// FLOPs of `products` attention products over `pairs` visible (query, key) pairs (summed over
/// batch and query heads) at head dim `head_dim`: 2 · products · pairs · head_dim (each product
/// is a multiply-add per pair and head-dim element). The one home of the attention FLOP formula.
pub fn attn_product_flops(products: u64, pairs: u128, head_dim: u64) -> u128 {
    2 * products as u128 * pairs * head_dim as u128
}

/// The window of a plain (`false`) or causal (`true`) call.
pub fn causal_window(causal: bool) -> Window {
    (None, causal.then_some(0))
}

/// The sizes of one attention call that the counts need (from a validated problem).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnSizes {
    pub batch: u64,
    /// Query / key rows over all sequences: padded batch·s, varlen the total rows.
    pub rows_q: u64,
    pub rows_k: u64,
    /// Per-sequence lengths of the pair count (varlen: total / batch, rounded).
    pub seqlen_q: u64,
    pub seqlen_k: u64,
    pub heads: u64,
    pub heads_k: u64,
    /// The call's head dim (not the kernel's, which may be padded to a multiple of 32).
    pub head_dim: u64,
    /// Bytes of one q/k/v/out element (2 for fp16/bf16).
    pub elem_bytes: u64,
    pub varlen: bool,
}

const F32_BYTES: u64 = 4;
const I32_BYTES: u64 = 4;

impl AttnSizes {
    /// Sizes of a validated call: `q` / `k` are its q and k metadata (their first dim gives the
    /// total rows in varlen mode).
    pub fn new(p: &Problem, q: &TensorMeta, k: &TensorMeta) -> AttnSizes {
        let u = |x: i64| x.max(0) as u64;
        let batch = u(p.batch);
        let (rows_q, rows_k, seqlen_q, seqlen_k) = if p.varlen {
            let (tq, tk) = (u(q.shape[0]), u(k.shape[0]));
            let avg = |total: u64| (total + batch / 2).checked_div(batch).unwrap_or(0);
            (tq, tk, avg(tq), avg(tk))
        } else {
            let (sq, sk) = (u(p.seqlen_q), u(p.seqlen_k));
            (batch * sq, batch * sk, sq, sk)
        };
        AttnSizes {
            batch,
            rows_q,
            rows_k,
            seqlen_q,
            seqlen_k,
            heads: u(p.heads),
            heads_k: u(p.heads_k),
            head_dim: u(p.head_dim),
            elem_bytes: p.dtype.size_bytes() as u64,
            varlen: p.varlen,
        }
    }

    /// Unmasked (query, key) pairs over every (batch, query head) under `window`
    /// (`variant::visible_pairs`).
    pub fn pairs(&self, window: Window) -> f64 {
        (self.batch as u128
            * self.heads as u128
            * visible_pairs(self.seqlen_q, self.seqlen_k, window)) as f64
    }

    /// FLOPs of `products` tensor-core products over the unmasked pairs (`attn_product_flops`).
    fn product_flops(&self, products: u64, window: Window) -> f64 {
        let pairs = self.batch as u128 * self.heads as u128 * visible_pairs(self.seqlen_q, self.seqlen_k, window);
        attn_product_flops(products, pairs, self.head_dim) as f64
    }

    /// Bytes of a tensor shaped like q (q, out, dout, dq).
    fn q_like(&self) -> f64 {
        (self.rows_q * self.heads * self.head_dim * self.elem_bytes) as f64
    }

    /// Bytes of a tensor shaped like k (k, v, dk, dv).
    fn kv_like(&self) -> f64 {
        (self.rows_k * self.heads_k * self.head_dim * self.elem_bytes) as f64
    }

    /// Bytes of one fp32 value per query row and head (softmax_lse, softmax_d).
    fn row_stat(&self) -> f64 {
        (self.rows_q * self.heads * F32_BYTES) as f64
    }

    /// Bytes of the fp32 dq_accum workspace (q's shape).
    fn accum(&self) -> f64 {
        (self.rows_q * self.heads * self.head_dim * F32_BYTES) as f64
    }

    /// Bytes of cu_seqlens_q and cu_seqlens_k (varlen only).
    fn cu_seqlens(&self) -> f64 {
        if self.varlen {
            (2 * (self.batch + 1) * I32_BYTES) as f64
        } else {
            0.0
        }
    }

    fn work(&self, flops: f64, bytes: f64) -> Work {
        Work {
            flops,
            bytes: bytes + self.cu_seqlens(),
            exact: !self.varlen,
        }
    }

    /// The forward kernel: S = QKᵀ and O = PV (4·pairs·d FLOPs); reads q, k, v, writes out
    /// and softmax_lse.
    pub fn fwd(&self, window: Window) -> Work {
        let bytes = 2.0 * self.q_like() + 2.0 * self.kv_like() + self.row_stat();
        self.work(self.product_flops(2, window), bytes)
    }

    /// One backward kernel of `tuning::attention_bwd::bwd_plan` (`deterministic`: the plan
    /// without dq_accum).
    /// - Preprocess: 0 FLOPs; reads dout, out, writes softmax_d, zeroes dq_accum (default plan).
    /// - DkDv: products S, dP (with dK or dQ), dV, dK, dQ as enabled; reads q, k, v, dout,
    ///   softmax_lse, softmax_d (with dK or dQ), writes dk, dv, dq_accum as enabled.
    /// - DkDvSm90: as DkDv with dK, dV and (`dq`) dQ.
    /// - Dq: S, dP, dQ; reads q, k, v, dout, softmax_lse, softmax_d, writes dq.
    /// - ConvertDq: 0 FLOPs; reads dq_accum, writes dq.
    pub fn bwd(&self, kind: BwdKind, window: Window, deterministic: bool) -> Work {
        let inputs = 2.0 * self.q_like() + 2.0 * self.kv_like() + self.row_stat(); // q, dout, k, v, lse
        match kind {
            BwdKind::Preprocess => {
                let zeroed = if deterministic { 0.0 } else { self.accum() };
                self.work(0.0, 2.0 * self.q_like() + self.row_stat() + zeroed)
            }
            BwdKind::DkDvSm90 { dq, .. } => self.bwd(BwdKind::DkDv { dk: true, dv: true, dq }, window, deterministic),
            BwdKind::DkDv { dk, dv, dq } => {
                let ds = dk || dq;
                let products = 1 + [ds, dv, dk, dq].iter().filter(|&&b| b).count() as u64;
                let mut bytes = inputs;
                bytes += if ds { self.row_stat() } else { 0.0 };
                bytes += if dk { self.kv_like() } else { 0.0 };
                bytes += if dv { self.kv_like() } else { 0.0 };
                bytes += if dq { self.accum() } else { 0.0 };
                self.work(self.product_flops(products, window), bytes)
            }
            BwdKind::Dq => self.work(
                self.product_flops(3, window),
                inputs + self.row_stat() + self.q_like(),
            ),
            BwdKind::ConvertDq { .. } => self.work(0.0, self.accum() + self.q_like()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::arch::Arch;
    use crate::ops::test_support::t;
    use crate::tuning::attention_bwd::bwd_plan;
    use crate::tuning::variant::VariantKind;

    fn brute_force(s_q: u64, s_k: u64) -> u128 {
        let mut n = 0;
        for i in 0..s_q as i64 {
            for j in 0..s_k as i64 {
                if j <= i + s_k as i64 - s_q as i64 {
                    n += 1;
                }
            }
        }
        n
    }

    #[test]
    fn causal_pairs_match_a_brute_force_count() {
        for s_q in 0..40 {
            for s_k in 0..40 {
                assert_eq!(
                    visible_pairs(s_q, s_k, causal_window(true)),
                    brute_force(s_q, s_k),
                    "s_q {s_q} s_k {s_k}"
                );
                assert_eq!(visible_pairs(s_q, s_k, causal_window(false)), (s_q * s_k) as u128);
            }
        }
        for (s_q, s_k) in [
            (1, 1000),
            (1000, 1),
            (113, 97),
            (97, 113),
            (1025, 1024),
            (513, 2048),
        ] {
            assert_eq!(
                visible_pairs(s_q, s_k, causal_window(true)),
                brute_force(s_q, s_k),
                "s_q {s_q} s_k {s_k}"
            );
        }
        // s_q = s_k = s: s(s+1)/2; a 2^31-long sequence does not overflow
        assert_eq!(visible_pairs(4096, 4096, causal_window(true)), 4096 * 4097 / 2);
        let s = 1u64 << 31;
        assert_eq!(visible_pairs(s, s, causal_window(true)), (s as u128) * (s as u128 + 1) / 2);
        // a single query row (decode) sees every key
        assert_eq!(visible_pairs(1, 777, causal_window(true)), 777);
    }

    fn padded(b: i64, sq: i64, sk: i64, h: i64, hk: i64, d: i64) -> AttnSizes {
        let q = t(&[b, sq, h, d], DType::BF16);
        let k = t(&[b, sk, hk, d], DType::BF16);
        let p = Problem {
            varlen: false,
            batch: b,
            seqlen_q: sq,
            seqlen_k: sk,
            heads: h,
            heads_k: hk,
            head_dim: d,
            dtype: DType::BF16,
            device: 0,
        };
        AttnSizes::new(&p, &q, &k)
    }

    #[test]
    fn forward_counts() {
        let s = padded(2, 1024, 1024, 8, 2, 128);
        let w = s.fwd(causal_window(true));
        let pairs = 2.0 * 8.0 * (1024.0 * 1025.0 / 2.0);
        assert_eq!(w.flops, 4.0 * pairs * 128.0);
        assert_eq!(
            s.fwd(causal_window(false)).flops,
            4.0 * 2.0 * 8.0 * 1024.0 * 1024.0 * 128.0
        );
        // q, out (8 heads) + k, v (2 heads, GQA) in bf16 + lse fp32
        let q = 2.0 * 1024.0 * 8.0 * 128.0 * 2.0;
        let kv = 2.0 * 1024.0 * 2.0 * 128.0 * 2.0;
        assert_eq!(w.bytes, 2.0 * q + 2.0 * kv + 2.0 * 1024.0 * 8.0 * 4.0);
        assert!(w.exact);
    }

    fn plan_flops(s: &AttnSizes, hd: u32, causal: bool, deterministic: bool) -> f64 {
        bwd_plan(hd, VariantKind::from_causal(causal), deterministic, DType::BF16, Arch::Sm90a)
            .iter()
            .map(|c| s.bwd(c.kind, causal_window(causal), deterministic).flops)
            .sum()
    }

    #[test]
    fn backward_plans_relative_to_the_forward() {
        for (sq, sk) in [(1024, 1024), (113, 1025), (1025, 97), (1, 1)] {
            for causal in [false, true] {
                let s = padded(3, sq, sk, 4, 4, 64);
                let fwd = s.fwd(causal_window(causal)).flops;
                // default: S, dP, dV, dK, dQ in one kernel = 2.5x the forward's two products
                assert_eq!(plan_flops(&s, 64, causal, false), 2.5 * fwd);
                // deterministic: dkdv (S, dP, dV, dK) + dq kernel (S, dP, dQ) = 7 products
                assert_eq!(plan_flops(&s, 64, causal, true), 3.5 * fwd);
                let s = padded(3, sq, sk, 4, 2, 256);
                let fwd = s.fwd(causal_window(causal)).flops;
                // d256 on sm_90a: the single-pass wide kernel, as d <= 128
                assert_eq!(plan_flops(&s, 256, causal, false), 2.5 * fwd);
                assert_eq!(plan_flops(&s, 256, causal, true), 3.5 * fwd);
                // d > 128 split (d160..224): (S, dV) + (S, dP, dK, dQ) = 6 products
                let s = padded(3, sq, sk, 4, 2, 192);
                let fwd = s.fwd(causal_window(causal)).flops;
                assert_eq!(plan_flops(&s, 192, causal, false), 3.0 * fwd);
                // deterministic split: (S, dV) + (S, dP, dK) + (S, dP, dQ) = 8 products
                assert_eq!(plan_flops(&s, 192, causal, true), 4.0 * fwd);
            }
        }
    }

    #[test]
    fn backward_kernel_counts() {
        let s = padded(2, 100, 300, 6, 3, 64);
        let (pairs, d) = (s.pairs(causal_window(true)), 64.0);
        let q = 2.0 * 100.0 * 6.0 * 64.0 * 2.0;
        let kv = 2.0 * 300.0 * 3.0 * 64.0 * 2.0;
        let stat = 2.0 * 100.0 * 6.0 * 4.0;
        let acc = 2.0 * 100.0 * 6.0 * 64.0 * 4.0;
        let dkdv = |dk, dv, dq| s.bwd(BwdKind::DkDv { dk, dv, dq }, causal_window(true), false);
        assert_eq!(dkdv(true, true, true).flops, 10.0 * pairs * d);
        assert_eq!(dkdv(false, true, false).flops, 4.0 * pairs * d);
        assert_eq!(dkdv(true, false, true).flops, 8.0 * pairs * d);
        assert_eq!(dkdv(true, true, false).flops, 8.0 * pairs * d);
        assert_eq!(dkdv(true, false, false).flops, 6.0 * pairs * d);
        assert_eq!(s.bwd(BwdKind::Dq, causal_window(true), true).flops, 6.0 * pairs * d);
        assert_eq!(s.bwd(BwdKind::Preprocess, causal_window(true), false).flops, 0.0);
        assert_eq!(s.bwd(BwdKind::ConvertDq { tiled: false }, causal_window(true), false).flops, 0.0);
        // bytes: inputs q, dout, k, v, lse (+ D with dS); outputs as enabled
        assert_eq!(
            dkdv(true, true, true).bytes,
            2.0 * q + 2.0 * kv + 2.0 * stat + 2.0 * kv + acc
        );
        assert_eq!(
            dkdv(false, true, false).bytes,
            2.0 * q + 2.0 * kv + stat + kv
        );
        assert_eq!(
            s.bwd(BwdKind::Dq, causal_window(true), true).bytes,
            3.0 * q + 2.0 * kv + 2.0 * stat
        );
        assert_eq!(
            s.bwd(BwdKind::Preprocess, causal_window(true), false).bytes,
            2.0 * q + stat + acc
        );
        assert_eq!(s.bwd(BwdKind::Preprocess, causal_window(true), true).bytes, 2.0 * q + stat);
        assert_eq!(s.bwd(BwdKind::ConvertDq { tiled: false }, causal_window(true), false).bytes, acc + q);
    }

    #[test]
    fn varlen_assumes_equal_lengths_and_is_inexact() {
        // 3 sequences, 301 query rows and 600 key rows in all: 100 and 200 tokens each
        let q = t(&[301, 4, 64], DType::F16);
        let k = t(&[600, 2, 64], DType::F16);
        let p = Problem {
            varlen: true,
            batch: 3,
            seqlen_q: 150,
            seqlen_k: 250,
            heads: 4,
            heads_k: 2,
            head_dim: 64,
            dtype: DType::F16,
            device: 0,
        };
        let s = AttnSizes::new(&p, &q, &k);
        assert_eq!(
            (s.rows_q, s.rows_k, s.seqlen_q, s.seqlen_k),
            (301, 600, 100, 200)
        );
        let w = s.fwd(causal_window(true));
        assert!(!w.exact);
        assert_eq!(
            w.flops,
            4.0 * 3.0 * 4.0 * visible_pairs(100, 200, causal_window(true)) as f64 * 64.0
        );
        let bytes =
            2.0 * 301.0 * 4.0 * 64.0 * 2.0 + 2.0 * 600.0 * 2.0 * 64.0 * 2.0 + 301.0 * 4.0 * 4.0;
        assert_eq!(
            w.bytes,
            bytes + 2.0 * 4.0 * 4.0,
            "plus both cu_seqlens (batch + 1 int32 each)"
        );
        assert!(!s.bwd(BwdKind::ConvertDq { tiled: false }, causal_window(true), false).exact);
    }
}
