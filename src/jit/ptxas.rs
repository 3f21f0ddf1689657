//! Parse the resource usage ptxas prints with `--ptxas-options=-v` (in the NVRTC log):
//!
//! ```text
//! ptxas info    : Compiling entry function '_Z…' for 'sm_90a'
//! ptxas info    : Function properties for _Z…
//!     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
//! ptxas info    : Used 30 registers, used 1 barriers, 256 bytes smem, 400 bytes cmem[0]
//! ```

/// Resources of one kernel as ptxas reports them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resources {
    pub registers: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
    pub stack_bytes: u32,
    pub static_smem_bytes: u32,
}

/// The number right before `unit` in `line` ("…, 12 bytes spill stores" → 12).
fn number_before(line: &str, unit: &str) -> Option<u32> {
    let idx = line.find(unit)?;
    line[..idx]
        .trim_end()
        .rsplit(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// Resources of the entry function `lowered_name`, or None when the log has no entry for it.
pub fn parse(log: &str, lowered_name: &str) -> Option<Resources> {
    let mut res: Option<Resources> = None;
    let mut in_entry = false;
    for line in log.lines() {
        if line.contains("Compiling entry function") {
            in_entry = line.contains(&format!("'{lowered_name}'"));
            if in_entry {
                res = Some(Resources::default());
            }
            continue;
        }
        if line.contains("Function properties for") {
            // properties of this entry or of a device function it calls: both count for stack/spills
            continue;
        }
        let Some(r) = res.as_mut().filter(|_| in_entry) else {
            continue;
        };
        if line.contains("bytes stack frame") {
            r.stack_bytes = r
                .stack_bytes
                .max(number_before(line, "bytes stack frame").unwrap_or(0));
            r.spill_stores = r
                .spill_stores
                .max(number_before(line, "bytes spill stores").unwrap_or(0));
            r.spill_loads = r
                .spill_loads
                .max(number_before(line, "bytes spill loads").unwrap_or(0));
        }
        if line.contains("Used") && line.contains("registers") {
            r.registers = number_before(line, "registers").unwrap_or(0);
            r.static_smem_bytes = number_before(line, "bytes smem").unwrap_or(0);
        }
    }
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z3fooi' for 'sm_90a'
ptxas info    : Function properties for _Z3fooi
    8 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 30 registers, used 1 barriers, 256 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function '_Z3barv' for 'sm_90a'
ptxas info    : Function properties for _Z3barv
    3120 bytes stack frame, 3116 bytes spill stores, 3264 bytes spill loads
ptxas info    : Used 255 registers, used 0 barriers, 400 bytes cmem[0]";

    #[test]
    fn parses_each_entry() {
        assert_eq!(
            parse(LOG, "_Z3fooi"),
            Some(Resources {
                registers: 30,
                spill_stores: 0,
                spill_loads: 0,
                stack_bytes: 8,
                static_smem_bytes: 256
            })
        );
        assert_eq!(
            parse(LOG, "_Z3barv"),
            Some(Resources {
                registers: 255,
                spill_stores: 3116,
                spill_loads: 3264,
                stack_bytes: 3120,
                static_smem_bytes: 0
            })
        );
        assert_eq!(parse(LOG, "_Z3bazv"), None);
    }
}
