//! `hmoe make-test-model` and `hmoe demo`: synthetic models with real layouts.

use std::path::PathBuf;

use anyhow::{bail, Context};
use hmoe_gguf::GgufWriter;
use hmoe_quant::GgmlType;
use hmoe_synth::{
    deepseek2_layout_writer, deepseek2_writer, gpt_oss_layout_writer, gpt_oss_writer,
    qwen3moe_layout_writer, qwen3moe_writer, Deepseek2Spec, GptOssSpec, Qwen3MoeSpec,
};

/// Arguments of `hmoe make-test-model`.
#[derive(clap::Args, Debug)]
pub struct MakeModelArgs {
    /// Architecture: gpt-oss, qwen3moe or deepseek2.
    #[arg(long, default_value = "gpt-oss")]
    pub arch: String,
    /// Starting dimensions: `tiny` for every architecture; gpt-oss: `gpt-oss-120b-layers`
    /// (120b's per-layer dims, 2 layers, 32k vocabulary), `gpt-oss-120b`, `gpt-oss-20b`;
    /// qwen3moe: `qwen3-30b-a3b`, `qwen3-235b-a22b`; deepseek2: `deepseek-v3-layers` (V3's
    /// per-layer dims, 1 dense + 3 MoE layers, 32k vocabulary), `deepseek-v3` (the published
    /// models' full tables).
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
    /// Sliding window of even layers (gpt-oss).
    #[arg(long)]
    pub window: Option<usize>,
    /// Storage type of the expert matrices (qwen3moe, deepseek2): q8_0, q4_0, q4_k, q5_k, q6_k,
    /// f32 or an IQ type (iq1_s, iq1_m, iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s, iq4_nl, iq4_xs;
    /// random codes).
    /// Default q8_0. gpt-oss's experts are MXFP4 as in the published files.
    #[arg(long)]
    pub expert_type: Option<String>,
    /// Storage type of the experts' down matrices (qwen3moe, deepseek2), when not
    /// --expert-type (q4_k with q6_k down is how Q4_K_M files store most experts).
    #[arg(long)]
    pub down_expert_type: Option<String>,
    /// RoPE dimensions of each head (deepseek2's qk_rope_dim; the latent cache holds
    /// kv_lora_rank + these per position).
    #[arg(long)]
    pub rope_dim: Option<usize>,
    /// Leading dense layers (deepseek2).
    #[arg(long)]
    pub dense_layers: Option<usize>,
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
    /// Routing with locality (gpt-oss): routers that read mostly a running mean of the
    /// sequence, so consecutive tokens tend to reuse experts (what the device expert cache,
    /// `--moe-cache`, feeds on). F in 0..=1 is the share of that mean in the routing; a bare
    /// flag means 0.9. Needs a hidden size that is a multiple of 64.
    #[arg(long, value_name = "F", num_args = 0..=1, default_missing_value = "0.9")]
    pub routing_locality: Option<f32>,
}

impl MakeModelArgs {
    fn spec(&self) -> anyhow::Result<GptOssSpec> {
        if self.arch != "gpt-oss" {
            bail!(
                "make-test-model supports --arch gpt-oss (got '{}')",
                self.arch
            );
        }
        let mut s = match self.preset.as_str() {
            "tiny" => GptOssSpec::tiny(),
            "gpt-oss-120b-layers" => GptOssSpec::gpt_oss_120b_layers(2, 32000),
            "gpt-oss-120b" => GptOssSpec::gpt_oss_120b(),
            "gpt-oss-20b" => GptOssSpec::gpt_oss_20b(),
            other => bail!(
                "unknown preset '{other}' (tiny, gpt-oss-120b-layers, gpt-oss-120b, gpt-oss-20b)"
            ),
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
        s.routing_locality = self.routing_locality;
        s.validate().map_err(anyhow::Error::msg)?;
        Ok(s)
    }
}

impl MakeModelArgs {
    /// The writer for `--arch` with the preset and overrides applied.
    fn writer(&self) -> anyhow::Result<GgufWriter> {
        let set = |dst: &mut usize, v: Option<usize>| {
            if let Some(v) = v {
                *dst = v;
            }
        };
        let type_named = |name: &str| {
            GgmlType::from_name(name).with_context(|| format!("unknown tensor type '{name}'"))
        };
        let expert_type = || type_named(self.expert_type.as_deref().unwrap_or("q8_0"));
        let down_expert_type = || self.down_expert_type.as_deref().map(type_named).transpose();
        let unused = |flags: &[(&str, bool)]| -> anyhow::Result<()> {
            match flags.iter().find(|f| f.1) {
                Some((name, _)) => bail!("--{name} does not apply to --arch {}", self.arch),
                None => Ok(()),
            }
        };
        let w = match self.arch.as_str() {
            "gpt-oss" => {
                unused(&[
                    ("expert-type", self.expert_type.is_some()),
                    ("down-expert-type", self.down_expert_type.is_some()),
                    ("dense-layers", self.dense_layers.is_some()),
                    ("rope-dim", self.rope_dim.is_some()),
                ])?;
                let spec = self.spec()?;
                if self.sparse {
                    gpt_oss_layout_writer(&spec)
                } else {
                    gpt_oss_writer(&spec)
                }
            }
            "qwen3moe" => {
                unused(&[
                    ("dense-layers", self.dense_layers.is_some()),
                    ("rope-dim", self.rope_dim.is_some()),
                    ("window", self.window.is_some()),
                    ("routing-locality", self.routing_locality.is_some()),
                ])?;
                let mut s = match self.preset.as_str() {
                    "tiny" => Qwen3MoeSpec::tiny(),
                    "qwen3-30b-a3b" => Qwen3MoeSpec::qwen3_30b_a3b(),
                    "qwen3-235b-a22b" => Qwen3MoeSpec::qwen3_235b_a22b(),
                    other => bail!(
                        "unknown qwen3moe preset '{other}' (tiny, qwen3-30b-a3b, qwen3-235b-a22b)"
                    ),
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
                s.expert_type = expert_type()?;
                s.down_expert_type = down_expert_type()?;
                s.seed = self.seed;
                if self.sparse {
                    qwen3moe_layout_writer(&s)
                } else {
                    qwen3moe_writer(&s)
                }
            }
            "deepseek2" => {
                unused(&[
                    ("kv-heads", self.kv_heads.is_some()),
                    ("head-dim", self.head_dim.is_some()),
                    ("window", self.window.is_some()),
                    ("routing-locality", self.routing_locality.is_some()),
                ])?;
                let mut s = match self.preset.as_str() {
                    "tiny" => Deepseek2Spec::tiny(),
                    "deepseek-v3-layers" => Deepseek2Spec::deepseek_v3_layers(4, 1, 32000),
                    "deepseek-v3" => Deepseek2Spec::deepseek_v3(),
                    other => bail!("unknown deepseek2 preset '{other}' (tiny, deepseek-v3-layers, deepseek-v3)"),
                };
                set(&mut s.n_layer, self.layers);
                set(&mut s.n_layer_dense_lead, self.dense_layers);
                set(&mut s.qk_rope_dim, self.rope_dim);
                set(&mut s.n_embd, self.embd);
                set(&mut s.n_head, self.heads);
                set(&mut s.n_expert, self.experts);
                set(&mut s.n_expert_used, self.experts_used);
                set(&mut s.n_ff_exp, self.ff);
                set(&mut s.n_vocab, self.vocab);
                if self.experts.is_some() && !s.n_expert.is_multiple_of(s.n_group) {
                    // A custom expert count keeps the routing valid without groups.
                    (s.n_group, s.n_group_used) = (1, 1);
                }
                s.expert_type = expert_type()?;
                s.down_expert_type = down_expert_type()?;
                s.seed = self.seed;
                if self.sparse {
                    deepseek2_layout_writer(&s)
                } else {
                    deepseek2_writer(&s)
                }
            }
            other => bail!(
                "make-test-model supports --arch gpt-oss, qwen3moe, deepseek2 (got '{other}')"
            ),
        };
        w.map_err(anyhow::Error::msg)
    }
}

/// Runs `hmoe make-test-model`.
pub fn run(args: MakeModelArgs) -> anyhow::Result<()> {
    let writer = args.writer()?;
    match args.split_max_tensors {
        Some(n) => {
            let paths = writer
                .write_split(&args.output, n)
                .context("writing shards")?;
            for p in paths {
                println!("{}", p.display());
            }
        }
        None => {
            writer
                .write(&args.output)
                .with_context(|| format!("writing {}", args.output.display()))?;
            println!("{}", args.output.display());
        }
    }
    Ok(())
}
