//! On / off environment switches and the one rule for their values (`1` / `on`, `0` / `off`;
//! empty or unset: the default), shared by the tuning knobs' on/off values (tuning/knobs) and
//! the switches outside the knobs (FERROATTN_LINEINFO in jit; FERROATTN_CHECK_CU_SEQLENS and
//! FERROATTN_EAGER_FASTPATH through `_native.env_switch`). A leaf module: it imports only `error`.

use crate::error::{Error, Result};

/// The names of on and off, first the canonical text.
pub const ON: &[&str] = &["1", "on"];
pub const OFF: &[&str] = &["0", "off"];
/// How errors word the accepted values.
pub const EXPECTED: &str = "one of 1, on, 0, off";

/// A variable's value; one that is not UTF-8 as its lossy form marked so (which no switch or knob
/// accepts, so the variable is named in the error rather than ignored).
pub fn env_value(var: &str) -> Option<String> {
    std::env::var_os(var).map(|v| v.into_string().unwrap_or_else(|v| format!("{} (not UTF-8)", v.to_string_lossy())))
}

/// The on / off switch `var`: `default` when unset or empty (after trimming). ArgumentError
/// naming `var`, the accepted values and the value otherwise.
pub fn env_switch(var: &str, default: bool) -> Result<bool> {
    // std::env::var_os reports an empty name or one with '=' or NUL as unset (no variable can
    // have it): such a name is an error, never silently the default
    if var.is_empty() || var.contains('=') || var.contains('\0') {
        return Err(Error::argument("var", "an environment variable name (non-empty, no '=' or NUL)", format!("{var:?}")));
    }
    let Some(text) = env_value(var) else { return Ok(default) };
    match text.trim() {
        "" => Ok(default),
        t if ON.contains(&t) => Ok(true),
        t if OFF.contains(&t) => Ok(false),
        _ => Err(Error::argument(var, EXPECTED, format!("{text:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_switches_take_the_on_off_rule() {
        let var = "FERROATTN_TEST_ENV_SWITCH_RULE";
        for (text, want) in [("1", Some(true)), (" on ", Some(true)), ("0", Some(false)), ("off", Some(false)), ("", None)] {
            std::env::set_var(var, text);
            assert_eq!(env_switch(var, true).unwrap(), want.unwrap_or(true), "{text:?}");
            assert_eq!(env_switch(var, false).unwrap(), want.unwrap_or(false), "{text:?}");
        }
        std::env::set_var(var, "false");
        let e = env_switch(var, true).unwrap_err().to_string();
        assert!(e.contains(var) && e.contains("\"false\"") && e.contains(EXPECTED), "{e}");
        std::env::remove_var(var);
        assert!(env_switch(var, true).unwrap());
        for bad in ["", "A=B", "A\0B"] {
            let e = env_switch(bad, true).unwrap_err().to_string();
            assert!(e.contains("var") && e.contains("environment variable name"), "{e}");
        }
    }
}
