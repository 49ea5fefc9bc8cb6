//! `hmoe serve`'s server-wide defaults for the samplers beyond the basic cuts (llama-server's
//! flags and defaults): locally typical, top-n-sigma, XTC, DRY, mirostat and the chain's
//! order. Requests override each one with the field of the same meaning.

use anyhow::bail;
use hmoe_engine::{Mirostat, SamplerStage};
use hmoe_server::config::SamplingDefaults;

/// Sampler defaults beyond `--temp`, `--top-k`, `--top-p` and `--min-p`.
#[derive(clap::Args, Debug, Clone)]
pub struct SamplerFlags {
    /// Default locally typical sampling mass (`typical_p`; 1 = off).
    #[arg(long = "typical", default_value_t = 1.0)]
    pub typical: f32,
    /// Default top-n-sigma: keep logits within n standard deviations of the top (≤ 0 = off).
    #[arg(long = "top-n-sigma", default_value_t = -1.0, allow_negative_numbers = true)]
    pub top_n_sigma: f32,
    /// Default XTC probability (0 = off).
    #[arg(long = "xtc-probability", default_value_t = 0.0)]
    pub xtc_probability: f32,
    /// Default XTC threshold (above 0.5 = off).
    #[arg(long = "xtc-threshold", default_value_t = 0.1)]
    pub xtc_threshold: f32,
    /// Default DRY multiplier (0 = off).
    #[arg(long = "dry-multiplier", default_value_t = 0.0)]
    pub dry_multiplier: f32,
    /// Default DRY base.
    #[arg(long = "dry-base", default_value_t = 1.75)]
    pub dry_base: f32,
    /// Default longest repeat DRY leaves alone.
    #[arg(long = "dry-allowed-length", default_value_t = 2)]
    pub dry_allowed_length: usize,
    /// Default context tokens DRY looks at (-1 = the whole context, 0 = off).
    #[arg(long = "dry-penalty-last-n", default_value_t = -1, allow_negative_numbers = true)]
    pub dry_penalty_last_n: i64,
    /// A DRY sequence breaker (repeatable; replaces the defaults "\n", ":", "\"", "*";
    /// "none" for none).
    #[arg(long = "dry-sequence-breaker")]
    pub dry_sequence_breaker: Vec<String>,
    /// Default mirostat (0 = off, 1 = mirostat, 2 = mirostat 2.0).
    #[arg(long = "mirostat", default_value_t = 0)]
    pub mirostat: u8,
    /// Default mirostat learning rate (eta).
    #[arg(long = "mirostat-lr", default_value_t = 0.1)]
    pub mirostat_lr: f32,
    /// Default mirostat target entropy (tau).
    #[arg(long = "mirostat-ent", default_value_t = 5.0)]
    pub mirostat_ent: f32,
    /// Default sampler order: names separated by ';' (penalties;dry;top_n_sigma;top_k;typ_p;
    /// top_p;min_p;xtc;temperature).
    #[arg(long = "samplers")]
    pub samplers: Option<String>,
    /// Default sampler order as letters (edskypmxt); --samplers wins.
    #[arg(long = "sampling-seq")]
    pub sampling_seq: Option<String>,
}

impl SamplerFlags {
    /// Checks the flags and sets them as `s`'s defaults.
    pub fn apply(&self, s: &mut SamplingDefaults) -> anyhow::Result<()> {
        let finite = [
            ("--typical", self.typical),
            ("--top-n-sigma", self.top_n_sigma),
            ("--xtc-probability", self.xtc_probability),
            ("--xtc-threshold", self.xtc_threshold),
            ("--dry-multiplier", self.dry_multiplier),
            ("--dry-base", self.dry_base),
            ("--mirostat-lr", self.mirostat_lr),
            ("--mirostat-ent", self.mirostat_ent),
        ];
        for (flag, v) in finite {
            if !v.is_finite() {
                bail!("{flag} must be a finite number (got {v})");
            }
        }
        let p = &mut s.params;
        p.typical_p = self.typical;
        p.top_n_sigma = self.top_n_sigma;
        p.xtc_probability = self.xtc_probability;
        p.xtc_threshold = self.xtc_threshold;
        p.dry.multiplier = self.dry_multiplier;
        p.dry.base = self.dry_base;
        p.dry.allowed_length = self.dry_allowed_length;
        p.dry.penalty_last_n = match self.dry_penalty_last_n {
            -1 => None,
            n if n >= 0 => Some(n as usize),
            n => bail!("--dry-penalty-last-n must be -1 (the whole context) or more (got {n})"),
        };
        p.mirostat = match self.mirostat {
            0 => Mirostat::Off,
            1 => Mirostat::V1,
            2 => Mirostat::V2,
            m => bail!("--mirostat must be 0, 1 or 2 (got {m})"),
        };
        p.mirostat_eta = self.mirostat_lr;
        p.mirostat_tau = self.mirostat_ent;
        let names = || {
            SamplerStage::DEFAULT_ORDER
                .map(SamplerStage::name)
                .join(";")
        };
        if let Some(list) = &self.samplers {
            p.order = (list.split(';').map(str::trim).filter(|n| !n.is_empty()))
                .map(|n| match SamplerStage::from_name(n) {
                    Some(stage) => Ok(stage),
                    None => bail!("--samplers: hmoe has no sampler '{n}' (it has {})", names()),
                })
                .collect::<anyhow::Result<_>>()?;
        } else if let Some(seq) = &self.sampling_seq {
            p.order = (seq.chars())
                .map(|c| match SamplerStage::from_char(c) {
                    Some(stage) => Ok(stage),
                    None => bail!("--sampling-seq: hmoe has no sampler '{c}' (it has edskypmxt)"),
                })
                .collect::<anyhow::Result<_>>()?;
        }
        match self.dry_sequence_breaker.as_slice() {
            [] => {}
            [none] if none == "none" => s.dry_sequence_breakers.clear(),
            given => s.dry_sequence_breakers = given.to_vec(),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        flags: SamplerFlags,
    }

    fn apply(args: &[&str]) -> anyhow::Result<SamplingDefaults> {
        let cli = Cli::try_parse_from(std::iter::once("x").chain(args.iter().copied()))?;
        let mut s = SamplingDefaults::default();
        cli.flags.apply(&mut s)?;
        Ok(s)
    }

    #[test]
    fn defaults_are_llama_servers_and_flags_set_them() {
        let d = apply(&[]).unwrap();
        assert_eq!(d.params, SamplingDefaults::default().params);
        let s = apply(&[
            "--typical",
            "0.9",
            "--xtc-probability",
            "0.5",
            "--dry-multiplier",
            "0.8",
            "--dry-penalty-last-n",
            "128",
            "--mirostat",
            "2",
            "--mirostat-ent",
            "3",
            "--samplers",
            "top_k;temperature",
            "--dry-sequence-breaker",
            "\n",
        ])
        .unwrap();
        let p = &s.params;
        assert_eq!(
            (p.typical_p, p.xtc_probability, p.dry.multiplier),
            (0.9, 0.5, 0.8)
        );
        assert_eq!(p.dry.penalty_last_n, Some(128));
        assert_eq!((p.mirostat, p.mirostat_tau), (Mirostat::V2, 3.0));
        assert_eq!(p.order, vec![SamplerStage::TopK, SamplerStage::Temperature]);
        assert_eq!(s.dry_sequence_breakers, vec!["\n".to_string()]);
        let seq = apply(&["--sampling-seq", "kt"]).unwrap();
        assert_eq!(seq.params.order, p.order);
        assert!(apply(&["--dry-sequence-breaker", "none"])
            .unwrap()
            .dry_sequence_breakers
            .is_empty());
    }

    #[test]
    fn bad_values_are_errors() {
        assert!(apply(&["--mirostat", "3"]).is_err());
        assert!(apply(&["--samplers", "top_k;infill"]).is_err());
        assert!(apply(&["--sampling-seq", "ki"]).is_err());
        assert!(apply(&["--dry-penalty-last-n", "-2"]).is_err());
        assert!(apply(&["--typical", "nan"]).is_err());
    }
}
