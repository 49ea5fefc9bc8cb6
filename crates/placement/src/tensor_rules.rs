//! The tensor rules of the command line (`-ot`, `--cpu-moe`, `--n-cpu-moe`) as regexes over
//! tensor names, first match wins, as llama.cpp applies them.

use regex::Regex;

use crate::device::DeviceId;
use crate::error::PlacementError;
use crate::flags::{TensorRule, FFN_EXPS_REGEX};

/// The rules in order, each a regex and the device it sends matching tensors to.
pub(crate) fn compile_rules(
    rules: &[TensorRule],
    n_gpus: usize,
) -> Result<Vec<(Regex, DeviceId)>, PlacementError> {
    let regex = |p: &str| {
        Regex::new(p).map_err(|e| PlacementError::BadRegex {
            pattern: p.to_string(),
            message: e.to_string(),
        })
    };
    let mut out = Vec::new();
    for r in rules {
        match r {
            TensorRule::Override { pattern, device } => {
                let dev = DeviceId::parse(device, n_gpus).ok_or_else(|| {
                    PlacementError::UnknownDevice {
                        device: device.clone(),
                        valid: DeviceId::valid_names(n_gpus),
                    }
                })?;
                out.push((regex(pattern)?, dev));
            }
            TensorRule::CpuMoe => out.push((regex(FFN_EXPS_REGEX)?, DeviceId::Cpu)),
            TensorRule::NCpuMoe(0) => {}
            TensorRule::NCpuMoe(n) => {
                out.push((regex(&layers_exps_regex(0..*n))?, DeviceId::Cpu));
            }
        }
    }
    Ok(out)
}

/// `blk\.(…)\.ffn_(up|down|gate|gate_up)_(ch|)exps` for the given layers.
pub(crate) fn layers_exps_regex(layers: impl Iterator<Item = u32>) -> String {
    let mut v: Vec<u32> = layers.collect();
    v.sort_unstable();
    v.dedup();
    format!(r"blk\.({}){}", numbers_regex(&v), FFN_EXPS_REGEX)
}

/// A regex alternation matching exactly the decimal strings of the sorted, distinct numbers
/// `v` (no leading zeros), compacted by decades: `[2-9]|[12][0-9]|3[0-5]` for 2..=35.
pub(crate) fn numbers_regex(v: &[u32]) -> String {
    // (prefix, units) per decade present.
    let mut decades: Vec<(u32, Vec<u32>)> = Vec::new();
    for &n in v {
        match decades.last_mut() {
            Some((p, units)) if *p == n / 10 => units.push(n % 10),
            _ => decades.push((n / 10, vec![n % 10])),
        }
    }
    let mut parts = Vec::new();
    let mut i = 0;
    while i < decades.len() {
        let (p, units) = &decades[i];
        let full = |d: &(u32, Vec<u32>)| (1..10).contains(&d.0) && d.1.len() == 10;
        // Consecutive full decades with one-digit prefixes merge: [1-3][0-9].
        let mut j = i;
        while full(&decades[i])
            && j + 1 < decades.len()
            && full(&decades[j + 1])
            && decades[j + 1].0 == decades[j].0 + 1
        {
            j += 1;
        }
        if j > i {
            parts.push(format!(
                "{}[0-9]",
                digit_class(&(*p..=decades[j].0).collect::<Vec<_>>())
            ));
        } else {
            let prefix = if *p == 0 {
                String::new()
            } else {
                p.to_string()
            };
            parts.push(format!("{prefix}{}", digit_class(units)));
        }
        i = j + 1;
    }
    parts.join("|")
}

/// `5`, `[2-9]`, `[0-35-7]`, `[13]` for sorted distinct digits.
fn digit_class(d: &[u32]) -> String {
    if d.len() == 1 {
        return d[0].to_string();
    }
    let mut body = String::new();
    let mut i = 0;
    while i < d.len() {
        let mut j = i;
        while j + 1 < d.len() && d[j + 1] == d[j] + 1 {
            j += 1;
        }
        body.push_str(&match j - i {
            0 => d[i].to_string(),
            1 => format!("{}{}", d[i], d[j]),
            _ => format!("{}-{}", d[i], d[j]),
        });
        i = j + 1;
    }
    format!("[{body}]")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn number_regexes_match_exactly_their_sets() {
        assert_eq!(
            numbers_regex(&(2..=35).collect::<Vec<_>>()),
            "[2-9]|[12][0-9]|3[0-5]"
        );
        assert_eq!(numbers_regex(&[7]), "7");
        assert_eq!(numbers_regex(&[0, 1, 3, 5, 6, 7]), "[0135-7]");
        assert_eq!(numbers_regex(&(0..=9).collect::<Vec<_>>()), "[0-9]");
        assert_eq!(
            numbers_regex(&(10..=29).chain(40..=49).collect::<Vec<_>>()),
            "[12][0-9]|4[0-9]"
        );
        assert_eq!(numbers_regex(&[100, 101, 102, 119]), "10[0-2]|119");
        // Pseudo-random subsets of 0..130, checked against every number below 200.
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for _ in 0..300 {
            let set: Vec<u32> = (0..130)
                .filter(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    !x.is_multiple_of(3)
                })
                .collect();
            if set.is_empty() {
                continue;
            }
            let re = Regex::new(&format!("^(?:{})$", numbers_regex(&set))).unwrap();
            for n in 0..200u32 {
                assert_eq!(
                    re.is_match(&n.to_string()),
                    set.contains(&n),
                    "{n} in {set:?}"
                );
            }
            assert!(!re.is_match("05"));
        }
    }
}
