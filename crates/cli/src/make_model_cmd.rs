//! `hmoe make-test-model` and `hmoe demo`: synthetic models with real layouts.

use std::path::PathBuf;

use anyhow::{bail, Context};
use hmoe_synth::{gpt_oss_layout_writer, gpt_oss_writer, GptOssSpec};

/// Arguments of `hmoe make-test-model`.
#[derive(clap::Args, Debug)]
pub struct MakeModelArgs {
    /// Architecture (gpt-oss).
    #[arg(long, default_value = "gpt-oss")]
    pub arch: String,
    /// Starting dimensions: `tiny`, `gpt-oss-120b-layers` (120b's per-layer dims, 2 layers,
    /// 32k vocabulary), `gpt-oss-120b` or `gpt-oss-20b` (the published models' full tables).
    #[arg(long, default_value = "tiny")]
    pub preset: String,
    /// Transformer blocks.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Hidden size.
    #[arg(long)]
    pub embd: Option<usize>,
    /// Query heads.
    #[arg(long)]
    pub heads: Option<usize>,
    /// Key/value heads.
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Head dimension.
    #[arg(long)]
    pub head_dim: Option<usize>,
    /// Experts per block.
    #[arg(long)]
    pub experts: Option<usize>,
    /// Experts used per token.
    #[arg(long)]
    pub experts_used: Option<usize>,
    /// Expert hidden size.
    #[arg(long)]
    pub ff: Option<usize>,
    /// Vocabulary size.
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Sliding window of even layers.
    #[arg(long)]
    pub window: Option<usize>,
    /// Random seed.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Output file; with --split-max-tensors, the shard prefix.
    #[arg(short = 'o', long = "output")]
    pub output: PathBuf,
    /// Split into shards of at most this many tensors (PREFIX-0000k-of-0000N.gguf).
    #[arg(long)]
    pub split_max_tensors: Option<usize>,
    /// Leave all tensor data as a file hole: the real layout without weights (for `fit`,
    /// `inspect`; it cannot be run).
    #[arg(long)]
    pub sparse: bool,
}

impl MakeModelArgs {
    fn spec(&self) -> anyhow::Result<GptOssSpec> {
        if self.arch != "gpt-oss" {
            bail!("make-test-model supports --arch gpt-oss (got '{}')", self.arch);
        }
        let mut s = match self.preset.as_str() {
            "tiny" => GptOssSpec::tiny(),
            "gpt-oss-120b-layers" => GptOssSpec::gpt_oss_120b_layers(2, 32000),
            "gpt-oss-120b" => GptOssSpec::gpt_oss_120b(),
            "gpt-oss-20b" => GptOssSpec::gpt_oss_20b(),
            other => bail!("unknown preset '{other}' (tiny, gpt-oss-120b-layers, gpt-oss-120b, gpt-oss-20b)"),
        };
        let set = |dst: &mut usize, v: Option<usize>| {
            if let Some(v) = v {
                *dst = v;
            }
        };
        set(&mut s.n_layer, self.layers);
        set(&mut s.n_embd, self.embd);
        set(&mut s.n_head, self.heads);
        set(&mut s.n_head_kv, self.kv_heads);
        set(&mut s.head_dim, self.head_dim);
        set(&mut s.n_expert, self.experts);
        set(&mut s.n_expert_used, self.experts_used);
        set(&mut s.n_ff_exp, self.ff);
        set(&mut s.n_vocab, self.vocab);
        set(&mut s.sliding_window, self.window);
        s.seed = self.seed;
        s.validate().map_err(anyhow::Error::msg)?;
        Ok(s)
    }
}

/// Runs `hmoe make-test-model`.
pub fn run(args: MakeModelArgs) -> anyhow::Result<()> {
    let spec = args.spec()?;
    let writer = if args.sparse { gpt_oss_layout_writer(&spec) } else { gpt_oss_writer(&spec) }
        .map_err(anyhow::Error::msg)?;
    match args.split_max_tensors {
        Some(n) => {
            let paths = writer.write_split(&args.output, n).context("writing shards")?;
            for p in paths {
                println!("{}", p.display());
            }
        }
        None => {
            writer.write(&args.output).with_context(|| format!("writing {}", args.output.display()))?;
            println!("{}", args.output.display());
        }
    }
    Ok(())
}
