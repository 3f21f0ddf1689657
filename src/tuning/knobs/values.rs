//! The text forms of the knob values (src/tuning/knobs.rs): how each typed value is parsed from its
//! environment variable or `set_tuning_knob` argument and written back (`text` of a parsed value
//! parses to the same value). Empty text is the knob's default (handled by `knobs::parse_knob`).

use crate::tuning::attention::KvRelease;
use crate::tuning::gemm::{parse_tile, StreamK, WmmaTile};
use crate::tuning::gemm_sm90::{Schedule, SchedulePolicy};
use crate::tuning::grid::GridPolicy;
use crate::tuning::sparse24::{FusePolicy, SplitPolicy, StreamKPolicy, Tile, TilePolicy, WgmmaEpilogue, WgmmaMainloop};

/// A knob value's text form.
pub trait KnobValue: Sized {
    /// The values accepted, for error messages (and the table in docs/DEVELOPING.md).
    const EXPECTED: &'static str;
    /// The value of trimmed, non-empty `text`, or None when it is not one of `EXPECTED`.
    fn parse(text: &str) -> Option<Self>;
    /// The canonical text of the value (parses back to it).
    fn text(&self) -> String;
}

/// A knob value that is one of a few names (`KnobValue` follows from its table).
pub trait Named: Copy + PartialEq + 'static {
    /// "one of " and every name of `NAMES`, in order (a test checks it).
    const EXPECTED: &'static str;
    /// Each value with the names that parse to it; the first is its text.
    const NAMES: &'static [(Self, &'static [&'static str])];
}

impl<T: Named> KnobValue for T {
    const EXPECTED: &'static str = <T as Named>::EXPECTED;
    fn parse(text: &str) -> Option<Self> {
        T::NAMES.iter().find(|(_, names)| names.contains(&text)).map(|(v, _)| *v)
    }
    fn text(&self) -> String {
        T::NAMES.iter().find(|(v, _)| v == self).map_or_else(String::new, |(_, names)| names[0].to_string())
    }
}

/// Which kernel family an attention call may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FamilyChoice {
    /// The dispatcher's choice (the fastest family that supports the call).
    #[default]
    Auto,
    /// Always the sm80 (mma.sync) family.
    Sm80,
    /// The sm90 family wherever it supports the call (else sm80).
    Sm90,
}

impl Named for FamilyChoice {
    const EXPECTED: &'static str = "one of auto, sm80, sm90";
    const NAMES: &'static [(Self, &'static [&'static str])] =
        &[(FamilyChoice::Auto, &["auto"]), (FamilyChoice::Sm80, &["sm80"]), (FamilyChoice::Sm90, &["sm90"])];
}

/// A choice the dispatcher's measured rule makes (`Auto`) unless a knob forces a value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice<T> {
    Auto,
    Fixed(T),
}

impl<T> Default for Choice<T> {
    fn default() -> Self {
        Choice::Auto
    }
}

impl<T: Copy> Choice<T> {
    /// The forced value, else the rule's.
    pub fn or(self, rule: T) -> T {
        match self {
            Choice::Auto => rule,
            Choice::Fixed(v) => v,
        }
    }
}

impl Named for Choice<KvRelease> {
    const EXPECTED: &'static str = "one of auto, together, separate";
    const NAMES: &'static [(Self, &'static [&'static str])] = &[
        (Choice::Auto, &["auto"]),
        (Choice::Fixed(KvRelease::Together), &["together"]),
        (Choice::Fixed(KvRelease::Separate), &["separate"]),
    ];
}

/// auto, or an on / off switch.
impl Named for Choice<bool> {
    const EXPECTED: &'static str = "one of auto, 1, on, 0, off";
    const NAMES: &'static [(Self, &'static [&'static str])] =
        &[(Choice::Auto, &["auto"]), (Choice::Fixed(true), crate::env_switch::ON), (Choice::Fixed(false), crate::env_switch::OFF)];
}

/// A ring depth: the tile rule's (`Auto`) or a forced number of slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum RingStages {
    #[default]
    Auto,
    Fixed(u32),
}

impl RingStages {
    /// The forced depth, if any.
    pub fn forced(self) -> Option<u32> {
        match self {
            RingStages::Auto => None,
            RingStages::Fixed(n) => Some(n),
        }
    }
}

impl KnobValue for RingStages {
    const EXPECTED: &'static str = "auto or an integer in 2..=8";
    fn parse(text: &str) -> Option<Self> {
        match text {
            "auto" => Some(RingStages::Auto),
            t => t.parse::<u32>().ok().filter(|n| (2..=8).contains(n)).map(RingStages::Fixed),
        }
    }
    fn text(&self) -> String {
        match self {
            RingStages::Auto => "auto".into(),
            RingStages::Fixed(n) => n.to_string(),
        }
    }
}

/// An on / off switch.
impl Named for bool {
    const EXPECTED: &'static str = crate::env_switch::EXPECTED;
    const NAMES: &'static [(Self, &'static [&'static str])] = &[(true, crate::env_switch::ON), (false, crate::env_switch::OFF)];
}

/// Tile rows per raster group of the WMMA GEMM's tile order (consecutive tiles walk the tile columns
/// of that many tile rows together, so the B tiles they share are reused in L2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RasterGroup(pub u32);

impl RasterGroup {
    /// The production raster group.
    pub const DEFAULT: RasterGroup = RasterGroup(8);
}

impl KnobValue for RasterGroup {
    const EXPECTED: &'static str = "an integer in 1..=4096";
    fn parse(text: &str) -> Option<Self> {
        text.parse::<u32>().ok().filter(|g| (1..=4096).contains(g)).map(RasterGroup)
    }
    fn text(&self) -> String {
        self.0.to_string()
    }
}

impl Named for SchedulePolicy {
    const EXPECTED: &'static str = "one of coop, pingpong, pingpong_c2, auto";
    const NAMES: &'static [(Self, &'static [&'static str])] = &[
        (SchedulePolicy::Fixed(Schedule::Cooperative), &["coop"]),
        (SchedulePolicy::Fixed(Schedule::PingPong), &["pingpong"]),
        (SchedulePolicy::Fixed(Schedule::PingPongCluster2), &["pingpong_c2"]),
        (SchedulePolicy::ByK, &["auto"]),
    ];
}

impl Named for StreamK {
    const EXPECTED: &'static str = "one of auto, off, 0, on, 1";
    const NAMES: &'static [(Self, &'static [&'static str])] =
        &[(StreamK::Auto, &["auto"]), (StreamK::Off, &["off", "0"]), (StreamK::On, &["on", "1"])];
}

impl KnobValue for GridPolicy {
    const EXPECTED: &'static str = "balanced, full or an integer >= 1";
    fn parse(text: &str) -> Option<Self> {
        match text {
            "balanced" => Some(GridPolicy::Balanced),
            "full" => Some(GridPolicy::Full),
            t => t.parse::<u64>().ok().filter(|g| *g >= 1).map(GridPolicy::Max),
        }
    }
    fn text(&self) -> String {
        match self {
            GridPolicy::Balanced => "balanced".into(),
            GridPolicy::Full => "full".into(),
            GridPolicy::Max(n) => n.to_string(),
        }
    }
}

/// A forced tile, or the heuristic's ("auto").
impl<T: KnobValue> KnobValue for Option<T> {
    const EXPECTED: &'static str = "auto or a tile (see docs/DEVELOPING.md)";
    fn parse(text: &str) -> Option<Self> {
        match text {
            "auto" => Some(None),
            t => T::parse(t).map(Some),
        }
    }
    fn text(&self) -> String {
        self.as_ref().map_or_else(|| "auto".into(), T::text)
    }
}

/// "bm,bn,bk,warps_m,warps_n,stages[,double_buffer 0|1[,mbarrier 0|1[,persistent 0|1]]]".
impl KnobValue for WmmaTile {
    const EXPECTED: &'static str = "bm,bn,bk,warps_m,warps_n,stages[,double_buffer[,mbarrier[,persistent]]]";
    fn parse(text: &str) -> Option<Self> {
        parse_tile(text)
    }
    fn text(&self) -> String {
        let t = self;
        let f = |b: bool| u32::from(b);
        format!(
            "{},{},{},{},{},{},{},{},{}",
            t.bm, t.bn, t.bk, t.warps_m, t.warps_n, t.stages, f(t.double_buffer), f(t.mbarrier), f(t.persistent)
        )
    }
}

/// "block_n,block_r,warps_n,warps_r,stages" of a valid mma.sp tile.
impl KnobValue for Tile {
    const EXPECTED: &'static str = "block_n,block_r,warps_n,warps_r,stages";
    fn parse(text: &str) -> Option<Self> {
        Tile::parse(text)
    }
    fn text(&self) -> String {
        format!("{},{},{},{},{}", self.block_n, self.block_r, self.warps_n, self.warps_r, self.stages)
    }
}

impl KnobValue for SplitPolicy {
    const EXPECTED: &'static str = "auto, off, 0 or a chunk count >= 1";
    fn parse(text: &str) -> Option<Self> {
        match text {
            "auto" => Some(SplitPolicy::Auto),
            "0" | "off" => Some(SplitPolicy::Off),
            v => v.parse::<u32>().ok().filter(|&n| n >= 1).map(SplitPolicy::Force),
        }
    }
    fn text(&self) -> String {
        match self {
            SplitPolicy::Auto => "auto".into(),
            SplitPolicy::Off => "off".into(),
            SplitPolicy::Force(n) => n.to_string(),
        }
    }
}

impl Named for FusePolicy {
    const EXPECTED: &'static str = "one of auto, 1, 0";
    const NAMES: &'static [(Self, &'static [&'static str])] =
        &[(FusePolicy::Auto, &["auto"]), (FusePolicy::On, &["1"]), (FusePolicy::Off, &["0"])];
}

impl KnobValue for TilePolicy {
    const EXPECTED: &'static str = "auto, 256, 128 or band:H (H >= 1)";
    fn parse(text: &str) -> Option<Self> {
        match text {
            "auto" => Some(TilePolicy::Auto),
            "256" => Some(TilePolicy::Only256),
            "128" => Some(TilePolicy::Force128),
            v => v
                .strip_prefix("band:")
                .and_then(|h| h.trim().parse::<u64>().ok())
                .filter(|&h| h >= 1)
                .map(TilePolicy::Banded),
        }
    }
    fn text(&self) -> String {
        match self {
            TilePolicy::Auto => "auto".into(),
            TilePolicy::Only256 => "256".into(),
            TilePolicy::Force128 => "128".into(),
            TilePolicy::Banded(h) => format!("band:{h}"),
        }
    }
}

impl KnobValue for StreamKPolicy {
    const EXPECTED: &'static str = "auto, off, on or dp:N (N >= 0)";
    fn parse(text: &str) -> Option<Self> {
        match text {
            "auto" => Some(StreamKPolicy::Auto),
            "off" => Some(StreamKPolicy::Off),
            "on" => Some(StreamKPolicy::On),
            v => v.strip_prefix("dp:").and_then(|n| n.trim().parse::<u64>().ok()).map(StreamKPolicy::DpTiles),
        }
    }
    fn text(&self) -> String {
        match self {
            StreamKPolicy::Auto => "auto".into(),
            StreamKPolicy::Off => "off".into(),
            StreamKPolicy::On => "on".into(),
            StreamKPolicy::DpTiles(n) => format!("dp:{n}"),
        }
    }
}

impl Named for WgmmaEpilogue {
    const EXPECTED: &'static str = "one of smem, staged, 1, direct, 0";
    const NAMES: &'static [(Self, &'static [&'static str])] =
        &[(WgmmaEpilogue::Staged, &["smem", "staged", "1"]), (WgmmaEpilogue::Direct, &["direct", "0"])];
}

impl Named for WgmmaMainloop {
    const EXPECTED: &'static str = "one of wait0, 1, pipe, 2";
    const NAMES: &'static [(Self, &'static [&'static str])] =
        &[(WgmmaMainloop::Wait0, &["wait0", "1"]), (WgmmaMainloop::Pipe, &["pipe", "2"])];
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `text` parses back to the value, for every `values`; every `bad` is rejected.
    fn round_trip<T: KnobValue + PartialEq + std::fmt::Debug>(values: &[T], bad: &[&str]) {
        for v in values {
            assert_eq!(T::parse(&v.text()).as_ref(), Some(v), "{v:?} -> {:?}", v.text());
        }
        for b in bad {
            assert!(T::parse(b).is_none(), "{b:?} accepted");
        }
    }

    #[test]
    fn every_value_type_round_trips_and_rejects_bad_text() {
        round_trip(&[FamilyChoice::Auto, FamilyChoice::Sm80, FamilyChoice::Sm90], &["hopper", "SM80"]);
        round_trip(&[true, false], &["yes", "2", "true"]);
        round_trip(&[Choice::Auto, Choice::Fixed(KvRelease::Together), Choice::Fixed(KvRelease::Separate)], &["split", "1"]);
        round_trip(&[Choice::Auto, Choice::Fixed(true), Choice::Fixed(false)], &["2", "yes", "separate"]);
        round_trip(&[RingStages::Auto, RingStages::Fixed(2), RingStages::Fixed(8)], &["1", "9", "0", "x"]);
        round_trip(&[RasterGroup(1), RasterGroup(8), RasterGroup(4096)], &["0", "4097", "x", "-1"]);
        round_trip(
            &[SchedulePolicy::ByK, SchedulePolicy::Fixed(Schedule::Cooperative), SchedulePolicy::Fixed(Schedule::PingPong),
              SchedulePolicy::Fixed(Schedule::PingPongCluster2)],
            &["cooperative", "x"],
        );
        round_trip(&[StreamK::Auto, StreamK::Off, StreamK::On], &["2", "yes"]);
        round_trip(&[GridPolicy::Balanced, GridPolicy::Full, GridPolicy::Max(128)], &["0", "-4", "all"]);
        let wt = parse_tile("128,128,32,2,4,4,1,1,1").unwrap();
        round_trip(&[None, Some(wt)], &["128,128", "x", "7,7,7,7,7,7"]);
        let t = Tile::parse("64,64,2,2,3").unwrap();
        round_trip(&[None, Some(t)], &["64,64,2,2", "65,64,2,2,3"]);
        round_trip(&[SplitPolicy::Auto, SplitPolicy::Off, SplitPolicy::Force(1), SplitPolicy::Force(3)], &["-1", "two"]);
        round_trip(&[FusePolicy::Auto, FusePolicy::On, FusePolicy::Off], &["yes", "2"]);
        round_trip(
            &[TilePolicy::Auto, TilePolicy::Only256, TilePolicy::Force128, TilePolicy::Banded(41)],
            &["band:0", "band:x", "64"],
        );
        round_trip(
            &[StreamKPolicy::Auto, StreamKPolicy::Off, StreamKPolicy::On, StreamKPolicy::DpTiles(0), StreamKPolicy::DpTiles(528)],
            &["dp:-1", "1"],
        );
        round_trip(&[WgmmaEpilogue::Staged, WgmmaEpilogue::Direct], &["fast", "2"]);
        round_trip(&[WgmmaMainloop::Wait0, WgmmaMainloop::Pipe], &["3", "0"]);
    }

    /// `EXPECTED` is "one of " and every name of `NAMES`; every value has a name.
    fn names_are_listed<T: Named + std::fmt::Debug>() {
        let names: Vec<_> = T::NAMES.iter().flat_map(|(_, n)| n.iter().copied()).collect();
        assert_eq!(<T as Named>::EXPECTED, format!("one of {}", names.join(", ")));
        assert!(T::NAMES.iter().all(|(v, n)| !n.is_empty() && T::parse(n[0]) == Some(*v)), "{:?}", T::NAMES);
    }

    #[test]
    fn named_values_list_their_names() {
        names_are_listed::<FamilyChoice>();
        names_are_listed::<bool>();
        names_are_listed::<Choice<KvRelease>>();
        names_are_listed::<Choice<bool>>();
        names_are_listed::<SchedulePolicy>();
        names_are_listed::<StreamK>();
        names_are_listed::<FusePolicy>();
        names_are_listed::<WgmmaEpilogue>();
        names_are_listed::<WgmmaMainloop>();
    }

    #[test]
    fn aliases_parse_to_their_values() {
        assert_eq!(bool::parse("on"), Some(true));
        assert_eq!(bool::parse("off"), Some(false));
        assert_eq!(StreamK::parse("0"), Some(StreamK::Off));
        assert_eq!(StreamK::parse("1"), Some(StreamK::On));
        assert_eq!(SplitPolicy::parse("0"), Some(SplitPolicy::Off));
        assert_eq!(TilePolicy::parse("band: 3"), Some(TilePolicy::Banded(3)));
        assert_eq!(WgmmaEpilogue::parse("staged"), Some(WgmmaEpilogue::Staged));
        assert_eq!(WgmmaEpilogue::parse("1"), Some(WgmmaEpilogue::Staged));
        assert_eq!(WgmmaEpilogue::parse("0"), Some(WgmmaEpilogue::Direct));
        assert_eq!(WgmmaMainloop::parse("1"), Some(WgmmaMainloop::Wait0));
        assert_eq!(WgmmaMainloop::parse("2"), Some(WgmmaMainloop::Pipe));
        // a six-field WMMA tile: double-buffered, no mbarrier, not persistent
        let t = WmmaTile::parse("128,128,32,2,4,3").unwrap();
        assert!(t.double_buffer && !t.mbarrier && !t.persistent);
    }
}
