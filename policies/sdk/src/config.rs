//! The `key=value` configuration string that `lifecycle.init` passes.
//!
//! Grammar: pairs `key=value` (no blanks around `=`) separated by commas,
//! semicolons or whitespace; an empty string is the empty configuration.
//! A key may appear once. After [`crate::Policy::configure`] ran, any key it did
//! not read is refused as unknown, so a typo never passes silently.

use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::cell::Cell;
use core::str::FromStr;

/// A parsed configuration string.
#[derive(Debug)]
pub struct Config {
    pairs: Vec<(String, String, Cell<bool>)>,
}

impl Config {
    /// Parses `text`.
    pub fn parse(text: &str) -> Result<Config, String> {
        let mut pairs: Vec<(String, String, Cell<bool>)> = Vec::new();
        for item in text.split(|c: char| c == ',' || c == ';' || c.is_whitespace()).filter(|s| !s.is_empty()) {
            let (key, value) = item.split_once('=').ok_or_else(|| format!("`{item}` is not of the form key=value"))?;
            let (key, value) = (key.trim(), value.trim());
            if key.is_empty() {
                return Err(format!("`{item}` has an empty key"));
            }
            if pairs.iter().any(|(k, _, _)| k == key) {
                return Err(format!("key `{key}` is given twice"));
            }
            pairs.push((key.to_string(), value.to_string(), Cell::new(false)));
        }
        Ok(Config { pairs })
    }

    /// The raw value of `key`, if given (marks the key as known).
    pub fn raw(&self, key: &str) -> Option<&str> {
        self.pairs.iter().find(|(k, _, _)| k == key).map(|(_, v, used)| {
            used.set(true);
            v.as_str()
        })
    }

    /// The value of `key` parsed as `T`, or `default` when the key is absent.
    pub fn get_or<T: FromStr>(&self, key: &str, default: T) -> Result<T, String>
    where
        T::Err: core::fmt::Display,
    {
        match self.raw(key) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|e| format!("invalid value `{v}` for `{key}`: {e}")),
        }
    }

    /// The value of `key` as a byte size (`4096`, `512KiB`, `20MiB`, `2GiB`),
    /// or `default` when the key is absent.
    pub fn bytes_or(&self, key: &str, default: u64) -> Result<u64, String> {
        match self.raw(key) {
            None => Ok(default),
            Some(v) => parse_bytes(v).ok_or_else(|| {
                format!("invalid size `{v}` for `{key}` (expected bytes, or a number with KiB, MiB or GiB)")
            }),
        }
    }

    /// Whether no pair was given.
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// Fails naming the first key that was never read.
    pub fn check_all_used(&self) -> Result<(), String> {
        match self.pairs.iter().find(|(_, _, used)| !used.get()) {
            Some((k, _, _)) => Err(format!("unknown configuration key `{k}`")),
            None => Ok(()),
        }
    }
}

/// Parses `4096`, `512KiB`, `20MiB` or `2GiB` (binary units, integers only).
pub fn parse_bytes(text: &str) -> Option<u64> {
    let text = text.trim();
    let digits = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(digits);
    let shift = match unit.trim() {
        "" | "B" => 0,
        "KiB" => 10,
        "MiB" => 20,
        "GiB" => 30,
        _ => return None,
    };
    number.parse::<u64>().ok()?.checked_mul(1 << shift)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_pairs() {
        let c = Config::parse(" high=0.75, phase=step_end;x=1 ").unwrap();
        assert_eq!(c.get_or("high", 0.8).unwrap(), 0.75);
        assert_eq!(c.raw("phase"), Some("step_end"));
        assert!(c.check_all_used().is_err());
        assert_eq!(c.get_or("x", 0u32).unwrap(), 1);
        assert_eq!(c.get_or("absent", 7u32).unwrap(), 7);
        assert!(c.check_all_used().is_ok());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("4096"), Some(4096));
        assert_eq!(parse_bytes("20MiB"), Some(20 << 20));
        assert_eq!(parse_bytes("2 GiB"), Some(2 << 30));
        assert_eq!(parse_bytes("1.5MiB"), None);
        assert_eq!(parse_bytes("MiB"), None);
        assert_eq!(parse_bytes("99999999999GiB"), None);
        let c = Config::parse("chunk=4MiB").unwrap();
        assert_eq!(c.bytes_or("chunk", 0).unwrap(), 4 << 20);
        assert_eq!(c.bytes_or("other", 7).unwrap(), 7);
    }

    #[test]
    fn refuses_malformed() {
        assert!(Config::parse("").unwrap().is_empty());
        assert!(Config::parse("novalue").is_err());
        assert!(Config::parse("=3").is_err());
        assert!(Config::parse("a=1,a=2").is_err());
        assert!(Config::parse("a=x").unwrap().get_or("a", 1u32).is_err());
    }
}
