//! Durations in policy files: `500ms`, `30s`, `15m`, `2h`, `1d` and sums such as `1h30m`.

/// The longest duration a policy may state (365 days), so `now + duration` never overflows.
pub const DURATION_MS_MAX: u64 = 365 * 24 * 60 * 60 * 1000;

/// Parses a duration into milliseconds. The string is one or more `<digits><unit>` parts with
/// unit `ms`, `s`, `m`, `h` or `d`, summed; no spaces, no signs, no fractions. Zero is refused:
/// every duration in a policy is a limit, and a limit of nothing is a typo.
pub fn parse_ms(text: &str) -> Result<u64, String> {
    const HINT: &str =
        "write a duration such as \"500ms\", \"30s\", \"15m\", \"2h\", \"1d\" or \"1h30m\"";
    if text.is_empty() {
        return Err(format!("empty duration; {HINT}"));
    }
    let bytes = text.as_bytes();
    let mut total: u64 = 0;
    let mut i = 0;
    while i < bytes.len() {
        let digits_start = i;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        if i == digits_start {
            return Err(format!(
                "bad duration {text:?}: expected a number at byte {i}; {HINT}"
            ));
        }
        let unit_start = i;
        while i < bytes.len() && bytes[i].is_ascii_alphabetic() {
            i += 1;
        }
        let unit_ms: u64 = match &text[unit_start..i] {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            "" => {
                return Err(format!(
                    "bad duration {text:?}: a number needs a unit; {HINT}"
                ));
            }
            unit => {
                return Err(format!(
                    "bad duration {text:?}: unknown unit {unit:?}; {HINT}"
                ));
            }
        };
        let part = text[digits_start..unit_start]
            .parse::<u64>()
            .ok()
            .and_then(|n| n.checked_mul(unit_ms))
            .and_then(|ms| total.checked_add(ms));
        match part {
            Some(sum) if sum <= DURATION_MS_MAX => total = sum,
            _ => {
                return Err(format!(
                    "duration {text:?} is longer than the limit of 365d"
                ));
            }
        }
    }
    if total == 0 {
        return Err(format!("duration {text:?} is zero; {HINT}"));
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::parse_ms;

    #[test]
    fn parses_units_and_sums() {
        assert_eq!(parse_ms("500ms"), Ok(500));
        assert_eq!(parse_ms("30s"), Ok(30_000));
        assert_eq!(parse_ms("15m"), Ok(900_000));
        assert_eq!(parse_ms("2h"), Ok(7_200_000));
        assert_eq!(parse_ms("1d"), Ok(86_400_000));
        assert_eq!(parse_ms("1h30m"), Ok(5_400_000));
        assert_eq!(parse_ms("1m30s250ms"), Ok(90_250));
        assert_eq!(parse_ms("365d"), Ok(super::DURATION_MS_MAX));
    }

    #[test]
    fn refuses_bad_durations() {
        for bad in [
            "",
            "15",
            "m",
            "15 m",
            "-1s",
            "1.5h",
            "1w",
            "0s",
            "0m0s",
            "366d",
            "99999999999999999999d",
            "1h-",
        ] {
            assert!(parse_ms(bad).is_err(), "{bad:?} should be refused");
        }
        assert!(parse_ms("1w").unwrap_err().contains("unknown unit \"w\""));
        assert!(parse_ms("15").unwrap_err().contains("needs a unit"));
    }
}
