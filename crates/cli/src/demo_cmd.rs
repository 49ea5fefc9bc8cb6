//! `hmoe demo`: writes a small synthetic gpt-oss model and generates from it, so a newcomer
//! sees the whole pipeline (GGUF writer and reader, kernels, forward pass, sampling) run.

use std::time::Instant;

use anyhow::Context;
use hmoe_engine::{Generator, Sampler, SamplerParams};
use hmoe_model::KvType;
use hmoe_synth::{gpt_oss_writer, GptOssSpec};

/// Arguments of `hmoe demo`.
#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// Where to write the model (default: a temporary file).
    #[arg(short = 'o', long = "output")]
    pub output: Option<std::path::PathBuf>,
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 32)]
    pub n_predict: usize,
}

/// Runs `hmoe demo`.
pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    let path = args.output.unwrap_or_else(|| {
        std::env::temp_dir().join(format!("hmoe-demo-{}.gguf", std::process::id()))
    });
    let spec = GptOssSpec::tiny();
    let start = Instant::now();
    gpt_oss_writer(&spec)
        .map_err(anyhow::Error::msg)?
        .write(&path)?;
    println!(
        "wrote {} ({} layers, {} experts top-{}) in {:.0} ms",
        path.display(),
        spec.n_layer,
        spec.n_expert,
        spec.n_expert_used,
        start.elapsed().as_secs_f64() * 1e3
    );
    let gguf = hmoe_gguf::GgufModel::open(&path, hmoe_gguf::LoadOptions::default())
        .with_context(|| format!("loading {}", path.display()))?;
    let model = hmoe_model::load(gguf)?;
    let tokenizer = hmoe_tokenizer::Tokenizer::from_metadata(model.gguf().metadata())?;
    let prompt = tokenizer.encode("Hello from hmoe!", true, false)?;
    let mut sampler = Sampler::new(SamplerParams {
        temperature: 0.0,
        ..SamplerParams::default()
    });
    let mut generator = Generator::new(model.as_ref(), KvType::F16, 512, 512);
    let out = generator.generate(
        &prompt,
        args.n_predict,
        &mut sampler,
        None,
        0,
        &|_| false,
        &mut |_| true,
    )?;
    println!("prompt ids {:?}", out.prompt_tokens);
    println!("generated ids {:?}", out.generated);
    println!(
        "generated text (random weights, so noise): {:?}",
        String::from_utf8_lossy(&tokenizer.decode(&out.generated))
    );
    let t = &out.timings;
    println!(
        "prompt {:.1} t/s, generation {:.1} t/s",
        t.prompt_tps(),
        t.decode_tps()
    );
    let hmoe = hmoe_command();
    println!(
        "next: `{hmoe} chat -m {0}` talks to it in the terminal, `{hmoe} serve -m {0}` serves it \
         with a chat page at http://127.0.0.1:8080/ (it carries gpt-oss's chat template; its \
         answers are noise). For real answers, serve a real GGUF (see README.md, \"With a real \
         model\"); scripts/fetch-real-models.sh fetches two small real ones.",
        path.display()
    );
    if hmoe != "hmoe" {
        println!(
            "(`hmoe` is not on PATH: `cargo install --path crates/cli` puts it in ~/.cargo/bin)"
        );
    }
    Ok(())
}

/// How to call this binary in a printed command: `hmoe` when that name on `PATH` is this very
/// file, else the path of the running binary (after `cargo run`, `hmoe` is usually not on
/// `PATH`, and a printed `hmoe ...` would not run).
pub(crate) fn hmoe_command() -> String {
    let Ok(me) = std::env::current_exe().and_then(std::fs::canonicalize) else {
        return "hmoe".into();
    };
    let on_path = std::env::var_os("PATH").is_some_and(|paths| {
        std::env::split_paths(&paths)
            .any(|dir| std::fs::canonicalize(dir.join("hmoe")).is_ok_and(|p| p == me))
    });
    if on_path {
        return "hmoe".into();
    }
    let shown = me.display().to_string();
    if shown
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "/._-+".contains(c))
    {
        shown
    } else {
        format!("'{}'", shown.replace('\'', r"'\''"))
    }
}
