//! 2:4 sparse matmul: the environment switches of the wgmma_sp path (tile, stream-k, split-k,
//! epilogue and mainloop forms; read per call).

use super::*;

/// Whether the wgmma_sp kernel may run: on unless FERROATTN_SPARSE24_WGMMA is "0" (a switch for a
/// GPU run that finds it wrong; its harness passed 23/23 on the H200 after the metadata-register
/// fix, bench/results/sparse24_wgmma_harness_20261130T0412/).
pub(super) fn wgmma_enabled() -> bool {
    std::env::var("FERROATTN_SPARSE24_WGMMA").map_or(true, |v| v.trim() != "0")
}

/// Which tile wgmma_sp may use: $FERROATTN_WGMMA_SP_TILE ("auto" or unset: `wgmma_schedule`'s rule;
/// "256": the 256-row tile only; "128": the 128-row tile always; "band:H": the banded schedule with H
/// 256-row feature tiles first). Read per call (same-process A/B).
pub(super) fn wgmma_tile_policy() -> Result<TilePolicy> {
    let v = std::env::var("FERROATTN_WGMMA_SP_TILE").ok();
    parse_wgmma_tile(v.as_deref()).ok_or_else(|| {
        let got = format!("{:?}", v.unwrap_or_default());
        Error::argument("FERROATTN_WGMMA_SP_TILE", "\"auto\", \"256\", \"128\", \"band:H\" (H >= 1) or unset", got)
    })
}

/// When wgmma_sp runs the stream-K tail: $FERROATTN_WGMMA_SP_STREAMK ("auto" or unset: the cost rule of
/// `wgmma_schedule`; "off": never; "on": always, the rule's tail; "dp:N": always, N whole tiles
/// first). Read per call (same-process A/B).
pub(super) fn wgmma_stream_k_policy() -> Result<StreamKPolicy> {
    let v = std::env::var("FERROATTN_WGMMA_SP_STREAMK").ok();
    parse_wgmma_stream_k(v.as_deref()).ok_or_else(|| {
        let got = format!("{:?}", v.unwrap_or_default());
        Error::argument("FERROATTN_WGMMA_SP_STREAMK", "\"auto\", \"off\", \"on\", \"dp:N\" or unset", got)
    })
}

/// When split-k fuses the reduce ($FERROATTN_SPARSE24_SPLITK_FUSE: unset = `fuse_split`'s measured
/// rule, "1" always, "0" never). Read per call.
pub(super) fn wgmma_split_fuse_policy() -> Result<FusePolicy> {
    let v = std::env::var("FERROATTN_SPARSE24_SPLITK_FUSE").ok();
    parse_wgmma_split_fuse(v.as_deref()).ok_or_else(|| {
        let got = format!("{:?}", v.unwrap_or_default());
        Error::argument("FERROATTN_SPARSE24_SPLITK_FUSE", "\"0\", \"1\" or unset", got)
    })
}

/// How wgmma_sp splits k: $FERROATTN_SPARSE24_SPLITK ("auto" or unset: the cost rule of
/// `wgmma_split_plan`; "off" / "0": never; a number n >= 1: n chunks). Read per call
/// (same-process A/B in benchmarks).
pub(super) fn wgmma_split_policy() -> Result<SplitPolicy> {
    let v = std::env::var("FERROATTN_SPARSE24_SPLITK").ok();
    parse_wgmma_split(v.as_deref()).ok_or_else(|| {
        Error::argument(
            "FERROATTN_SPARSE24_SPLITK",
            "\"auto\", \"off\", \"0\", a chunk count >= 1, or unset",
            format!("{:?}", v.unwrap_or_default()),
        )
    })
}

/// The wgmma_sp epilogue form: $FERROATTN_WGMMA_SP_EPILOGUE ("direct" / "0": stores from the
/// accumulator registers; "smem" / "staged" / "1": staged through shared memory; unset: the
/// production default `WGMMA_EPILOGUE_DEFAULT`). Read per call (same-process A/B in benchmarks).
pub(super) fn wgmma_epilogue() -> Result<u32> {
    wgmma_form_env(
        "FERROATTN_WGMMA_SP_EPILOGUE",
        "\"direct\", \"smem\", \"0\", \"1\" or unset",
        parse_wgmma_epilogue,
    )
}

/// The wgmma_sp mainloop form: $FERROATTN_WGMMA_SP_MAINLOOP ("wait0" / "1": wgmma.wait_group 0
/// after every stage; "pipe" / "2": two metadata register sets, one stage of wgmmas in flight;
/// unset: the production default `WGMMA_META_SETS_DEFAULT`). Read per call (same-process A/B).
pub(super) fn wgmma_mainloop() -> Result<u32> {
    wgmma_form_env(
        "FERROATTN_WGMMA_SP_MAINLOOP",
        "\"wait0\", \"pipe\", \"1\", \"2\" or unset",
        parse_wgmma_mainloop,
    )
}

/// A wgmma_sp kernel form chosen by the environment variable `var`, read per call: `parse` maps
/// its value (None when unset) to the form, or to None for a value it does not know, which
/// raises ArgumentError naming `var`, the `expected` values and the value given.
pub(super) fn wgmma_form_env(
    var: &str,
    expected: &str,
    parse: fn(Option<&str>) -> Option<u32>,
) -> Result<u32> {
    let v = std::env::var(var).ok();
    parse(v.as_deref())
        .ok_or_else(|| Error::argument(var, expected, format!("{:?}", v.unwrap_or_default())))
}

/// A tile forced by $FERROATTN_SPARSE24_TILE ("block_n,block_r,warps_n,warps_r,stages"; for
/// experiments and benchmarks of alternative tiles). Unset: None; malformed: ArgumentError.
pub(super) fn tile_override() -> Result<Option<Tile>> {
    match std::env::var("FERROATTN_SPARSE24_TILE") {
        Err(_) => Ok(None),
        Ok(s) if s.is_empty() => Ok(None),
        Ok(s) => Tile::parse(&s).map(Some).ok_or_else(|| {
            Error::argument(
                "FERROATTN_SPARSE24_TILE",
                "block_n,block_r,warps_n,warps_r,stages of a valid tile",
                format!("{s:?}"),
            )
        }),
    }
}

