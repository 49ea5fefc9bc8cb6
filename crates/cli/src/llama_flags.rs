//! llama-server's command line, flag by flag: every spelling its `--help` lists (llama.cpp
//! d32676d77, the baselines' build; `tests/data/llama-server-help.txt`), what each takes, its
//! environment variable, and what hmoe does with it.
//!
//! [`LLAMA_SERVER_FLAGS`] is the one table. Before clap parses `hmoe serve`,
//! [`rewrite_serve`] reads it: a flag hmoe implements is rewritten to hmoe's long spelling (so
//! clap never sees llama.cpp's multi-letter short flags such as `-ngl` or `-to`, which it would
//! read as `-n gl` or `-t o`); a flag that does not apply is taken off the command line, with
//! its values, and leaves one note for the start-up output; a flag whose effect is hmoe's
//! fixed behaviour (`--jinja`, `--cont-batching`) is taken off silently. `LLAMA_ARG_*`
//! variables (and `HMOE_ARG_*`, which win over them) become flags placed before the command
//! line's, and a variable whose flag is also on the command line is not read, as llama.cpp
//! does. The other commands share llama.cpp's multi-letter short flags for what they
//! implement ([`rewrite_short_flags`]).

/// What a flag takes after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Takes {
    /// Nothing: a switch.
    Nothing,
    /// One value.
    Value,
    /// An optional value (`-fa [on|off|auto]`): the next word, unless it is a flag.
    MaybeValue,
    /// Two values (`--control-vector-layer-range START END`).
    TwoValues,
}

/// What hmoe does with a flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Does {
    /// Implemented: hmoe's flag of the same meaning, by its long spelling.
    Hmoe(&'static str),
    /// What the flag asks for is what hmoe always does (accepted silently).
    Always,
    /// Does not apply to hmoe: accepted, ignored, and one note at start says why and what
    /// hmoe does instead.
    Note(&'static str),
}

/// The environment variable that sets a flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Env {
    /// None.
    No,
    /// The variable's value is the flag's value.
    Value(&'static str),
    /// A switch set by a true value of the variable (`1`, `true`, `on`, `enabled`).
    IfTrue(&'static str),
    /// A switch set by a false value (`0`, `false`, `off`, `disabled`): the negative half of a
    /// `--mmap`/`--no-mmap` pair.
    IfFalse(&'static str),
}

impl Env {
    /// The variable's name.
    pub fn name(self) -> Option<&'static str> {
        match self {
            Env::No => None,
            Env::Value(n) | Env::IfTrue(n) | Env::IfFalse(n) => Some(n),
        }
    }
}

/// One llama-server flag: its spellings of one meaning (a `--x`/`--no-x` pair is two rows).
#[derive(Clone, Copy, Debug)]
pub struct LlamaFlag {
    /// Every spelling, as llama-server's `--help` lists them.
    pub names: &'static [&'static str],
    /// What follows the flag.
    pub takes: Takes,
    /// The variable that sets it.
    pub env: Env,
    /// What hmoe does with it.
    pub does: Does,
}

impl LlamaFlag {
    /// The name notes use: the first long spelling.
    pub fn long_name(&self) -> &'static str {
        (self.names.iter().find(|n| n.starts_with("--")))
            .or(self.names.first())
            .copied()
            .unwrap_or_default()
    }
}

const fn hmoe(
    names: &'static [&'static str],
    takes: Takes,
    env: Env,
    long: &'static str,
) -> LlamaFlag {
    LlamaFlag {
        names,
        takes,
        env,
        does: Does::Hmoe(long),
    }
}

const fn always(names: &'static [&'static str], env: Env) -> LlamaFlag {
    LlamaFlag {
        names,
        takes: Takes::Nothing,
        env,
        does: Does::Always,
    }
}

const fn note(
    names: &'static [&'static str],
    takes: Takes,
    env: Env,
    why: &'static str,
) -> LlamaFlag {
    LlamaFlag {
        names,
        takes,
        env,
        does: Does::Note(why),
    }
}

use Env::{IfFalse, IfTrue, Value as V};
use Takes::{MaybeValue as Maybe, Nothing as Switch, TwoValues as Two, Value as One};

const NO: Env = Env::No;
const AFFINITY: &str = "hmoe's -t threads are not pinned to CPUs and run at normal priority";
const ROPE: &str = "hmoe uses the RoPE parameters the model file gives";
const SAMPLER: &str = "hmoe has no adaptive-p or dynamic-temperature sampler; the server's \
                       other llama-server sampling flags are its defaults";
const GRAMMAR: &str = "hmoe sets no server-wide grammar or schema";
const DRAFT: &str = "hmoe has no speculative decoding: the model generates every token itself";
const ADAPTER: &str = "hmoe loads no LoRA adapters or control vectors: the model runs as the \
                       file has it";
const DOWNLOAD: &str = "hmoe does not download models: download the GGUF file(s) and pass -m FILE";
const MEDIA: &str = "hmoe serves text models: no multimodal projector is loaded";
const LOG_LINE: &str = "hmoe's log lines always carry a timestamp and level";
const NO_CLI: &str = "it applies to llama.cpp's command-line tools, not to the server";
const TOOLS: &str = "hmoe runs no built-in tools or MCP servers; clients run their tools";
const UI: &str = "hmoe's chat page has its own settings, kept in the browser";
const CORS: &str = "hmoe answers CORS for --cors-origins with its fixed methods and headers";
const NO_CACHE_RAM: &str =
    "each slot keeps its own prompt cache of -c / -np positions; there is no \
                            cache in RAM beyond the slots";
const PRESET: &str = "hmoe does not download models: download the GGUF and pass -m FILE";

/// Every flag of llama-server's `--help`, in its order.
#[rustfmt::skip]
pub const LLAMA_SERVER_FLAGS: &[LlamaFlag] = &[
    // ----- common params -----
    hmoe(&["-h", "--help", "--usage"], Switch, NO, "--help"),
    hmoe(&["--version"], Switch, NO, "--version"),
    note(&["-cl", "--cache-list"], Switch, NO, "hmoe keeps no model cache"),
    note(&["--completion-bash"], Switch, NO, "hmoe prints no completion script"),
    hmoe(&["-t", "--threads"], One, V("LLAMA_ARG_THREADS"), "--threads"),
    note(&["-tb", "--threads-batch"], One, NO, "prompt batches use the -t threads"),
    note(&["-C", "--cpu-mask"], One, NO, AFFINITY),
    note(&["-Cr", "--cpu-range"], One, NO, AFFINITY),
    note(&["--cpu-strict"], One, NO, AFFINITY),
    note(&["--prio"], One, NO, AFFINITY),
    note(&["--poll"], One, NO, "idle pool threads poll briefly, then park (HMOE_POOL_SPIN_US)"),
    note(&["-Cb", "--cpu-mask-batch"], One, NO, AFFINITY),
    note(&["-Crb", "--cpu-range-batch"], One, NO, AFFINITY),
    note(&["--cpu-strict-batch"], One, NO, AFFINITY),
    note(&["--prio-batch"], One, NO, AFFINITY),
    note(&["--poll-batch"], One, NO, "idle pool threads poll briefly, then park (HMOE_POOL_SPIN_US)"),
    hmoe(&["-c", "--ctx-size"], One, V("LLAMA_ARG_CTX_SIZE"), "--ctx-size"),
    hmoe(&["-n", "--predict", "--n-predict"], One, V("LLAMA_ARG_N_PREDICT"), "--n-predict"),
    hmoe(&["-b", "--batch-size"], One, V("LLAMA_ARG_BATCH"), "--batch-size"),
    hmoe(&["-ub", "--ubatch-size"], One, V("LLAMA_ARG_UBATCH"), "--ubatch-size"),
    note(&["--keep"], One, NO, "hmoe does not shift the context, so keeps no prompt prefix through a shift"),
    note(&["--swa-full"], Switch, IfTrue("LLAMA_ARG_SWA_FULL"), "sliding-window layers keep window-sized caches"),
    hmoe(&["-fa", "--flash-attn"], Maybe, V("LLAMA_ARG_FLASH_ATTN"), "--flash-attn"),
    note(&["--perf"], Switch, IfTrue("LLAMA_ARG_PERF"), "each response carries its own timings; hmoe prints no libllama timings"),
    always(&["--no-perf"], IfFalse("LLAMA_ARG_PERF")),
    note(&["-e", "--escape"], Switch, NO, NO_CLI),
    note(&["--no-escape"], Switch, NO, NO_CLI),
    note(&["--rope-scaling"], One, V("LLAMA_ARG_ROPE_SCALING_TYPE"), ROPE),
    note(&["--rope-scale"], One, V("LLAMA_ARG_ROPE_SCALE"), ROPE),
    note(&["--rope-freq-base"], One, V("LLAMA_ARG_ROPE_FREQ_BASE"), ROPE),
    note(&["--rope-freq-scale"], One, V("LLAMA_ARG_ROPE_FREQ_SCALE"), ROPE),
    note(&["--yarn-orig-ctx"], One, V("LLAMA_ARG_YARN_ORIG_CTX"), ROPE),
    note(&["--yarn-ext-factor"], One, V("LLAMA_ARG_YARN_EXT_FACTOR"), ROPE),
    note(&["--yarn-attn-factor"], One, V("LLAMA_ARG_YARN_ATTN_FACTOR"), ROPE),
    note(&["--yarn-beta-slow"], One, V("LLAMA_ARG_YARN_BETA_SLOW"), ROPE),
    note(&["--yarn-beta-fast"], One, V("LLAMA_ARG_YARN_BETA_FAST"), ROPE),
    always(&["-kvo", "--kv-offload"], IfTrue("LLAMA_ARG_KV_OFFLOAD")),
    hmoe(&["-nkvo", "--no-kv-offload"], Switch, IfFalse("LLAMA_ARG_KV_OFFLOAD"), "--no-kv-offload"),
    always(&["--repack"], IfTrue("LLAMA_ARG_REPACK")),
    hmoe(&["-nr", "--no-repack"], Switch, IfFalse("LLAMA_ARG_REPACK"), "--no-repack"),
    note(&["--no-host"], Switch, IfTrue("LLAMA_ARG_NO_HOST"), "hmoe has no host buffer types"),
    hmoe(&["-ctk", "--cache-type-k"], One, V("LLAMA_ARG_CACHE_TYPE_K"), "--cache-type-k"),
    hmoe(&["-ctv", "--cache-type-v"], One, V("LLAMA_ARG_CACHE_TYPE_V"), "--cache-type-v"),
    note(&["-dt", "--defrag-thold"], One, V("LLAMA_ARG_DEFRAG_THOLD"), "each slot's cache is contiguous and needs no defragmentation"),
    hmoe(&["--mlock"], Switch, IfTrue("LLAMA_ARG_MLOCK"), "--mlock"),
    always(&["--mmap"], IfTrue("LLAMA_ARG_MMAP")),
    hmoe(&["--no-mmap"], Switch, IfFalse("LLAMA_ARG_MMAP"), "--no-mmap"),
    note(&["-dio", "--direct-io"], Switch, IfTrue("LLAMA_ARG_DIO"), "hmoe maps the file, or reads it with --no-mmap"),
    always(&["-ndio", "--no-direct-io"], IfFalse("LLAMA_ARG_DIO")),
    hmoe(&["-lm", "--load-mode"], One, V("LLAMA_ARG_LOAD_MODE"), "--load-mode"),
    note(&["--numa"], One, V("LLAMA_ARG_NUMA"), "hmoe does not place threads or memory by NUMA node"),
    hmoe(&["-dev", "--device"], One, V("LLAMA_ARG_DEVICE"), "--device"),
    hmoe(&["--list-devices"], Switch, NO, "--list-devices"),
    hmoe(&["-ot", "--override-tensor"], One, V("LLAMA_ARG_OVERRIDE_TENSOR"), "--override-tensor"),
    hmoe(&["-cmoe", "--cpu-moe"], Switch, IfTrue("LLAMA_ARG_CPU_MOE"), "--cpu-moe"),
    hmoe(&["-ncmoe", "--n-cpu-moe"], One, V("LLAMA_ARG_N_CPU_MOE"), "--n-cpu-moe"),
    hmoe(&["-ngl", "--gpu-layers", "--n-gpu-layers"], One, V("LLAMA_ARG_N_GPU_LAYERS"), "--n-gpu-layers"),
    note(&["-sm", "--split-mode"], One, V("LLAMA_ARG_SPLIT_MODE"), "the device executor runs on one device"),
    note(&["-ts", "--tensor-split"], One, V("LLAMA_ARG_TENSOR_SPLIT"), "the device executor runs on one device; -dev chooses it"),
    note(&["-mg", "--main-gpu"], One, V("LLAMA_ARG_MAIN_GPU"), "the device executor runs on one device; -dev chooses it"),
    hmoe(&["-fit", "--fit"], Maybe, V("LLAMA_ARG_FIT"), "--fit"),
    hmoe(&["-fitt", "--fit-target"], One, V("LLAMA_ARG_FIT_TARGET"), "--fit-target"),
    hmoe(&["-fitc", "--fit-ctx"], One, V("LLAMA_ARG_FIT_CTX"), "--fit-ctx"),
    note(&["--check-tensors"], Switch, NO, "hmoe checks each tensor's type, shape and extent at load, not its values"),
    note(&["--override-kv"], One, NO, "hmoe reads the model's metadata as the file has it"),
    always(&["--op-offload"], NO),
    hmoe(&["--no-op-offload"], Switch, NO, "--no-op-offload"),
    note(&["--lora"], One, NO, ADAPTER),
    note(&["--lora-scaled"], One, NO, ADAPTER),
    note(&["--control-vector"], One, NO, ADAPTER),
    note(&["--control-vector-scaled"], One, NO, ADAPTER),
    note(&["--control-vector-layer-range"], Two, NO, ADAPTER),
    hmoe(&["-m", "--model"], One, V("LLAMA_ARG_MODEL"), "--model"),
    note(&["-mu", "--model-url"], One, V("LLAMA_ARG_MODEL_URL"), DOWNLOAD),
    note(&["-dr", "--docker-repo"], One, V("LLAMA_ARG_DOCKER_REPO"), DOWNLOAD),
    hmoe(&["-hf", "-hfr", "--hf-repo"], One, V("LLAMA_ARG_HF_REPO"), "--hf-repo"),
    note(&["-hff", "--hf-file"], One, V("LLAMA_ARG_HF_FILE"), DOWNLOAD),
    note(&["-hft", "--hf-token"], One, V("HF_TOKEN"), DOWNLOAD),
    hmoe(&["--log-disable"], Switch, NO, "--log-disable"),
    note(&["--log-file"], One, V("LLAMA_ARG_LOG_FILE"), "hmoe logs to stderr: redirect it to a file"),
    note(&["--log-colors"], Maybe, V("LLAMA_ARG_LOG_COLORS"), "hmoe colours the log when stderr is a terminal"),
    hmoe(&["-v", "--verbose", "--log-verbose"], Switch, NO, "--verbose"),
    always(&["--offline"], IfTrue("LLAMA_ARG_OFFLINE")),
    hmoe(&["-lv", "--verbosity", "--log-verbosity"], One, V("LLAMA_ARG_LOG_VERBOSITY"), "--log-verbosity"),
    always(&["--log-prefix"], IfTrue("LLAMA_ARG_LOG_PREFIX")),
    note(&["--no-log-prefix"], Switch, IfFalse("LLAMA_ARG_LOG_PREFIX"), LOG_LINE),
    always(&["--log-timestamps"], IfTrue("LLAMA_ARG_LOG_TIMESTAMPS")),
    note(&["--no-log-timestamps"], Switch, IfFalse("LLAMA_ARG_LOG_TIMESTAMPS"), LOG_LINE),
    note(&["--spec-draft-type-k", "-ctkd", "--cache-type-k-draft"], One, V("LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K"), DRAFT),
    note(&["--spec-draft-type-v", "-ctvd", "--cache-type-v-draft"], One, V("LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V"), DRAFT),
    // ----- sampling params -----
    hmoe(&["--samplers"], One, NO, "--samplers"),
    hmoe(&["-s", "--seed"], One, NO, "--seed"),
    hmoe(&["--sampler-seq", "--sampling-seq"], One, NO, "--sampling-seq"),
    note(&["--ignore-eos"], Switch, NO, "requests set ignore_eos"),
    hmoe(&["--temp", "--temperature"], One, NO, "--temp"),
    hmoe(&["--top-k"], One, V("LLAMA_ARG_TOP_K"), "--top-k"),
    hmoe(&["--top-p"], One, NO, "--top-p"),
    hmoe(&["--min-p"], One, NO, "--min-p"),
    hmoe(&["--top-nsigma", "--top-n-sigma"], One, NO, "--top-n-sigma"),
    hmoe(&["--xtc-probability"], One, NO, "--xtc-probability"),
    hmoe(&["--xtc-threshold"], One, NO, "--xtc-threshold"),
    hmoe(&["--typical", "--typical-p"], One, NO, "--typical"),
    hmoe(&["--repeat-last-n"], One, NO, "--repeat-last-n"),
    hmoe(&["--repeat-penalty"], One, NO, "--repeat-penalty"),
    hmoe(&["--presence-penalty"], One, NO, "--presence-penalty"),
    hmoe(&["--frequency-penalty"], One, NO, "--frequency-penalty"),
    hmoe(&["--dry-multiplier"], One, NO, "--dry-multiplier"),
    hmoe(&["--dry-base"], One, NO, "--dry-base"),
    hmoe(&["--dry-allowed-length"], One, NO, "--dry-allowed-length"),
    hmoe(&["--dry-penalty-last-n"], One, NO, "--dry-penalty-last-n"),
    hmoe(&["--dry-sequence-breaker"], One, NO, "--dry-sequence-breaker"),
    note(&["--adaptive-target"], One, NO, SAMPLER),
    note(&["--adaptive-decay"], One, NO, SAMPLER),
    note(&["--dynatemp-range"], One, NO, SAMPLER),
    note(&["--dynatemp-exp"], One, NO, SAMPLER),
    hmoe(&["--mirostat"], One, NO, "--mirostat"),
    hmoe(&["--mirostat-lr"], One, NO, "--mirostat-lr"),
    hmoe(&["--mirostat-ent"], One, NO, "--mirostat-ent"),
    note(&["-l", "--logit-bias"], One, NO, "requests set logit_bias"),
    note(&["--grammar"], One, NO, GRAMMAR),
    note(&["--grammar-file"], One, NO, GRAMMAR),
    note(&["-j", "--json-schema"], One, NO, GRAMMAR),
    note(&["-jf", "--json-schema-file"], One, NO, GRAMMAR),
    note(&["-bs", "--backend-sampling"], Switch, IfTrue("LLAMA_ARG_BACKEND_SAMPLING"), "hmoe samples on the CPU"),
    // ----- speculative params -----
    note(&["--spec-draft-hf", "-hfd", "-hfrd", "--hf-repo-draft"], One, V("LLAMA_ARG_SPEC_DRAFT_HF_REPO"), DRAFT),
    note(&["--spec-draft-threads", "-td", "--threads-draft"], One, NO, DRAFT),
    note(&["--spec-draft-threads-batch", "-tbd", "--threads-batch-draft"], One, NO, DRAFT),
    note(&["--spec-draft-cpu-mask", "-Cd", "--cpu-mask-draft"], One, NO, DRAFT),
    note(&["--spec-draft-cpu-range", "-Crd", "--cpu-range-draft"], One, NO, DRAFT),
    note(&["--spec-draft-cpu-strict", "--cpu-strict-draft"], One, NO, DRAFT),
    note(&["--spec-draft-prio", "--prio-draft"], One, NO, DRAFT),
    note(&["--spec-draft-poll", "--poll-draft"], One, NO, DRAFT),
    note(&["--spec-draft-cpu-mask-batch", "-Cbd", "--cpu-mask-batch-draft"], One, NO, DRAFT),
    note(&["--spec-draft-cpu-strict-batch", "--cpu-strict-batch-draft"], One, NO, DRAFT),
    note(&["--spec-draft-prio-batch", "--prio-batch-draft"], One, NO, DRAFT),
    note(&["--spec-draft-poll-batch", "--poll-batch-draft"], One, NO, DRAFT),
    note(&["--spec-draft-override-tensor", "-otd", "--override-tensor-draft"], One, NO, DRAFT),
    note(&["--spec-draft-cpu-moe", "-cmoed", "--cpu-moe-draft"], Switch, IfTrue("LLAMA_ARG_SPEC_DRAFT_CPU_MOE"), DRAFT),
    note(&["--spec-draft-n-cpu-moe", "--spec-draft-ncmoe", "-ncmoed", "--n-cpu-moe-draft"], One, V("LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE"), DRAFT),
    note(&["--spec-draft-n-max"], One, V("LLAMA_ARG_SPEC_DRAFT_N_MAX"), DRAFT),
    note(&["--spec-draft-n-min"], One, V("LLAMA_ARG_SPEC_DRAFT_N_MIN"), DRAFT),
    note(&["--spec-draft-p-split", "--draft-p-split"], One, V("LLAMA_ARG_SPEC_DRAFT_P_SPLIT"), DRAFT),
    note(&["--spec-draft-p-min", "--draft-p-min"], One, V("LLAMA_ARG_SPEC_DRAFT_P_MIN"), DRAFT),
    note(&["--spec-draft-backend-sampling"], Switch, IfTrue("LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING"), DRAFT),
    always(&["--no-spec-draft-backend-sampling"], IfFalse("LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING")),
    note(&["--spec-draft-device", "-devd", "--device-draft"], One, NO, DRAFT),
    note(&["--spec-draft-ngl", "-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft"], One, V("LLAMA_ARG_N_GPU_LAYERS_DRAFT"), DRAFT),
    note(&["--spec-draft-model", "-md", "--model-draft"], One, V("LLAMA_ARG_SPEC_DRAFT_MODEL"), DRAFT),
    note(&["--spec-type"], One, V("LLAMA_ARG_SPEC_TYPE"), DRAFT),
    note(&["--spec-ngram-mod-n-min"], One, NO, DRAFT),
    note(&["--spec-ngram-mod-n-max"], One, NO, DRAFT),
    note(&["--spec-ngram-mod-n-match"], One, NO, DRAFT),
    note(&["--spec-ngram-simple-size-n"], One, NO, DRAFT),
    note(&["--spec-ngram-simple-size-m"], One, NO, DRAFT),
    note(&["--spec-ngram-simple-min-hits"], One, NO, DRAFT),
    note(&["--spec-ngram-map-k-size-n"], One, NO, DRAFT),
    note(&["--spec-ngram-map-k-size-m"], One, NO, DRAFT),
    note(&["--spec-ngram-map-k-min-hits"], One, NO, DRAFT),
    note(&["--spec-ngram-map-k4v-size-n"], One, NO, DRAFT),
    note(&["--spec-ngram-map-k4v-size-m"], One, NO, DRAFT),
    note(&["--spec-ngram-map-k4v-min-hits"], One, NO, DRAFT),
    note(&["--draft", "--draft-n", "--draft-max"], One, V("LLAMA_ARG_DRAFT_MAX"), DRAFT),
    note(&["--draft-min", "--draft-n-min"], One, V("LLAMA_ARG_DRAFT_MIN"), DRAFT),
    note(&["--spec-ngram-size-n"], One, NO, DRAFT),
    note(&["--spec-ngram-size-m"], One, NO, DRAFT),
    note(&["--spec-ngram-min-hits"], One, NO, DRAFT),
    // ----- example-specific params -----
    note(&["-lcs", "--lookup-cache-static"], One, NO, DRAFT),
    note(&["-lcd", "--lookup-cache-dynamic"], One, NO, DRAFT),
    note(&["-ctxcp", "--ctx-checkpoints", "--swa-checkpoints"], One, V("LLAMA_ARG_CTX_CHECKPOINTS"), "hmoe keeps no context checkpoints"),
    note(&["-cms", "--checkpoint-min-step"], One, V("LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT"), "hmoe keeps no context checkpoints"),
    note(&["-cram", "--cache-ram"], One, V("LLAMA_ARG_CACHE_RAM"), NO_CACHE_RAM),
    note(&["-kvu", "--kv-unified"], Switch, IfTrue("LLAMA_ARG_KV_UNIFIED"), "each slot has its own cache of -c / -np positions"),
    always(&["-no-kvu", "--no-kv-unified"], IfFalse("LLAMA_ARG_KV_UNIFIED")),
    note(&["--cache-idle-slots"], Switch, IfTrue("LLAMA_ARG_CACHE_IDLE_SLOTS"), NO_CACHE_RAM),
    always(&["--no-cache-idle-slots"], IfFalse("LLAMA_ARG_CACHE_IDLE_SLOTS")),
    note(&["--context-shift"], Switch, IfTrue("LLAMA_ARG_CONTEXT_SHIFT"), "hmoe does not shift the context: generation stops when the slot is full"),
    always(&["--no-context-shift"], IfFalse("LLAMA_ARG_CONTEXT_SHIFT")),
    note(&["-r", "--reverse-prompt"], One, NO, "requests set their stop strings"),
    note(&["-sp", "--special"], Switch, NO, NO_CLI),
    note(&["--warmup"], Switch, NO, "hmoe runs no warm-up pass"),
    always(&["--no-warmup"], NO),
    note(&["--spm-infill"], Switch, NO, "hmoe serves no /infill"),
    hmoe(&["--pooling"], One, V("LLAMA_ARG_POOLING"), "--pooling"),
    hmoe(&["-np", "--parallel"], One, V("LLAMA_ARG_N_PARALLEL"), "--parallel"),
    always(&["-cb", "--cont-batching"], IfTrue("LLAMA_ARG_CONT_BATCHING")),
    note(&["-nocb", "--no-cont-batching"], Switch, IfFalse("LLAMA_ARG_CONT_BATCHING"), "hmoe always batches the slots' tokens together"),
    note(&["-mm", "--mmproj"], One, V("LLAMA_ARG_MMPROJ"), MEDIA),
    note(&["-mmu", "--mmproj-url"], One, V("LLAMA_ARG_MMPROJ_URL"), MEDIA),
    note(&["--mmproj-auto"], Switch, IfTrue("LLAMA_ARG_MMPROJ_AUTO"), MEDIA),
    always(&["--no-mmproj", "--no-mmproj-auto"], IfFalse("LLAMA_ARG_MMPROJ_AUTO")),
    note(&["--mmproj-offload"], Switch, IfTrue("LLAMA_ARG_MMPROJ_OFFLOAD"), MEDIA),
    always(&["--no-mmproj-offload"], IfFalse("LLAMA_ARG_MMPROJ_OFFLOAD")),
    note(&["--image-min-tokens"], One, V("LLAMA_ARG_IMAGE_MIN_TOKENS"), MEDIA),
    note(&["--image-max-tokens"], One, V("LLAMA_ARG_IMAGE_MAX_TOKENS"), MEDIA),
    note(&["--mtmd-batch-max-tokens"], One, V("LLAMA_ARG_MTMD_BATCH_MAX_TOKENS"), MEDIA),
    hmoe(&["-a", "--alias"], One, V("LLAMA_ARG_ALIAS"), "--alias"),
    hmoe(&["--tags"], One, V("LLAMA_ARG_TAGS"), "--tags"),
    note(&["--embd-normalize"], One, NO, "requests set embd_normalize (default 2), as in llama-server"),
    hmoe(&["--host"], One, V("LLAMA_ARG_HOST"), "--host"),
    hmoe(&["--port"], One, V("LLAMA_ARG_PORT"), "--port"),
    note(&["--reuse-port"], Switch, IfTrue("LLAMA_ARG_REUSE_PORT"), "one hmoe process binds its port alone"),
    note(&["--path"], One, V("LLAMA_ARG_STATIC_PATH"), "hmoe serves its own chat page at / (--no-webui: none)"),
    hmoe(&["--cors-origins"], One, V("LLAMA_ARG_CORS_ORIGINS"), "--cors-origins"),
    note(&["--cors-methods"], One, V("LLAMA_ARG_CORS_METHODS"), CORS),
    note(&["--cors-headers"], One, V("LLAMA_ARG_CORS_HEADERS"), CORS),
    always(&["--cors-credentials"], IfTrue("LLAMA_ARG_CORS_CREDENTIALS")),
    note(&["--no-cors-credentials"], Switch, IfFalse("LLAMA_ARG_CORS_CREDENTIALS"), CORS),
    note(&["--api-prefix"], One, V("LLAMA_ARG_API_PREFIX"), "hmoe serves its routes at the root"),
    note(&["--ui-config", "--webui-config"], One, V("LLAMA_ARG_UI_CONFIG"), UI),
    note(&["--ui-config-file", "--webui-config-file"], One, V("LLAMA_ARG_UI_CONFIG_FILE"), UI),
    note(&["--ui-mcp-proxy", "--webui-mcp-proxy"], Switch, IfTrue("LLAMA_ARG_UI_MCP_PROXY"), TOOLS),
    always(&["--no-ui-mcp-proxy", "--no-webui-mcp-proxy"], IfFalse("LLAMA_ARG_UI_MCP_PROXY")),
    note(&["--tools"], One, V("LLAMA_ARG_TOOLS"), TOOLS),
    note(&["--mcp-servers-config"], One, V("LLAMA_ARG_MCP_SERVERS_CONFIG"), TOOLS),
    note(&["--mcp-servers-json"], One, V("LLAMA_ARG_MCP_SERVERS_JSON"), TOOLS),
    note(&["-ag", "--agent"], Switch, IfTrue("LLAMA_ARG_AGENT"), TOOLS),
    always(&["-no-ag", "--no-agent"], IfFalse("LLAMA_ARG_AGENT")),
    always(&["--ui", "--webui"], IfTrue("LLAMA_ARG_UI")),
    hmoe(&["--no-ui", "--no-webui"], Switch, IfFalse("LLAMA_ARG_UI"), "--no-webui"),
    hmoe(&["--embedding", "--embeddings"], Switch, IfTrue("LLAMA_ARG_EMBEDDINGS"), "--embeddings"),
    hmoe(&["--rerank", "--reranking"], Switch, IfTrue("LLAMA_ARG_RERANKING"), "--reranking"),
    hmoe(&["--api-key"], One, V("LLAMA_API_KEY"), "--api-key"),
    hmoe(&["--api-key-file"], One, V("LLAMA_ARG_API_KEY_FILE"), "--api-key-file"),
    note(&["--ssl-key-file"], One, V("LLAMA_ARG_SSL_KEY_FILE"), "hmoe serves plain HTTP: put a TLS proxy in front"),
    note(&["--ssl-cert-file"], One, V("LLAMA_ARG_SSL_CERT_FILE"), "hmoe serves plain HTTP: put a TLS proxy in front"),
    hmoe(&["--chat-template-kwargs"], One, V("LLAMA_ARG_CHAT_TEMPLATE_KWARGS"), "--chat-template-kwargs"),
    hmoe(&["-to", "--timeout"], One, V("LLAMA_ARG_TIMEOUT"), "--timeout"),
    note(&["--sse-ping-interval"], One, V("LLAMA_ARG_SSE_PING_INTERVAL"), "streams send no pings; --timeout bounds a silent client"),
    note(&["--threads-http"], One, V("LLAMA_ARG_THREADS_HTTP"), "each connection has its own thread, up to --max-connections"),
    always(&["--cache-prompt"], IfTrue("LLAMA_ARG_CACHE_PROMPT")),
    note(&["--no-cache-prompt"], Switch, IfFalse("LLAMA_ARG_CACHE_PROMPT"), "prompt prefixes are reused per slot; requests set cache_prompt"),
    note(&["--cache-reuse"], One, V("LLAMA_ARG_CACHE_REUSE"), "prompt prefixes are reused per slot, without KV shifting"),
    hmoe(&["--metrics"], Switch, IfTrue("LLAMA_ARG_ENDPOINT_METRICS"), "--metrics"),
    note(&["--props"], Switch, IfTrue("LLAMA_ARG_ENDPOINT_PROPS"), "POST /props changes nothing in hmoe"),
    always(&["--slots"], IfTrue("LLAMA_ARG_ENDPOINT_SLOTS")),
    hmoe(&["--no-slots"], Switch, IfFalse("LLAMA_ARG_ENDPOINT_SLOTS"), "--no-slots"),
    hmoe(&["--slot-save-path"], One, NO, "--slot-save-path"),
    note(&["--media-path"], One, NO, MEDIA),
    hmoe(&["--models-dir"], One, V("LLAMA_ARG_MODELS_DIR"), "--models-dir"),
    hmoe(&["--models-preset"], One, V("LLAMA_ARG_MODELS_PRESET"), "--models-preset"),
    hmoe(&["--models-max"], One, V("LLAMA_ARG_MODELS_MAX"), "--models-max"),
    always(&["--models-autoload"], IfTrue("LLAMA_ARG_MODELS_AUTOLOAD")),
    hmoe(&["--no-models-autoload"], Switch, IfFalse("LLAMA_ARG_MODELS_AUTOLOAD"), "--no-models-autoload"),
    always(&["--jinja"], IfTrue("LLAMA_ARG_JINJA")),
    note(&["--no-jinja"], Switch, IfFalse("LLAMA_ARG_JINJA"), "hmoe always renders the Jinja chat template"),
    hmoe(&["--reasoning-format"], One, V("LLAMA_ARG_THINK"), "--reasoning-format"),
    hmoe(&["-rea", "--reasoning"], Maybe, V("LLAMA_ARG_REASONING"), "--reasoning"),
    hmoe(&["--reasoning-budget"], One, V("LLAMA_ARG_THINK_BUDGET"), "--reasoning-budget"),
    note(&["--reasoning-budget-message"], One, V("LLAMA_ARG_THINK_BUDGET_MESSAGE"), "hmoe enforces no thinking budget but 0 and -1"),
    note(&["--reasoning-preserve"], Switch, IfTrue("LLAMA_ARG_REASONING_PRESERVE"), "the chat template decides which reasoning it keeps"),
    always(&["--no-reasoning-preserve"], IfFalse("LLAMA_ARG_REASONING_PRESERVE")),
    hmoe(&["--chat-template"], One, V("LLAMA_ARG_CHAT_TEMPLATE"), "--chat-template"),
    hmoe(&["--chat-template-file"], One, V("LLAMA_ARG_CHAT_TEMPLATE_FILE"), "--chat-template-file"),
    note(&["--skip-chat-parsing"], Switch, IfTrue("LLAMA_ARG_SKIP_CHAT_PARSING"), "--reasoning-format none leaves reasoning in the content"),
    always(&["--no-skip-chat-parsing"], IfFalse("LLAMA_ARG_SKIP_CHAT_PARSING")),
    always(&["--prefill-assistant"], IfTrue("LLAMA_ARG_PREFILL_ASSISTANT")),
    hmoe(&["--no-prefill-assistant"], Switch, IfFalse("LLAMA_ARG_PREFILL_ASSISTANT"), "--no-prefill-assistant"),
    hmoe(&["-sps", "--slot-prompt-similarity"], One, NO, "--slot-prompt-similarity"),
    note(&["--lora-init-without-apply"], Switch, NO, ADAPTER),
    hmoe(&["--sleep-idle-seconds"], One, NO, "--sleep-idle-seconds"),
    note(&["--log-prompts-dir"], One, NO, "-v logs each request"),
    note(&["--embd-gemma-default"], Switch, NO, PRESET),
    note(&["--fim-qwen-1.5b-default"], Switch, NO, PRESET),
    note(&["--fim-qwen-3b-default"], Switch, NO, PRESET),
    note(&["--fim-qwen-7b-default"], Switch, NO, PRESET),
    note(&["--fim-qwen-7b-spec"], Switch, NO, PRESET),
    note(&["--fim-qwen-14b-spec"], Switch, NO, PRESET),
    note(&["--fim-qwen-30b-default"], Switch, NO, PRESET),
    note(&["--gpt-oss-20b-default"], Switch, NO, PRESET),
    note(&["--gpt-oss-120b-default"], Switch, NO, PRESET),
    note(&["--vision-gemma-4b-default"], Switch, NO, PRESET),
    note(&["--vision-gemma-12b-default"], Switch, NO, PRESET),
    note(&["--spec-default"], Switch, NO, DRAFT),
];

/// The row a command-line word names: `-ngl`, or `--ctx-size=4096` (with its value).
fn lookup(word: &str) -> Option<(&'static LlamaFlag, Option<&str>)> {
    let (name, value) = match word.split_once('=') {
        Some((n, v)) if n.starts_with("--") => (n, Some(v)),
        _ => (word, None),
    };
    // As llama.cpp: a long flag's underscores are dashes (`--backend_sampling`).
    let name = match name.strip_prefix("--") {
        Some(rest) => format!("--{}", rest.replace('_', "-")),
        None => name.to_string(),
    };
    (LLAMA_SERVER_FLAGS.iter())
        .find(|f| f.names.contains(&name.as_str()))
        .map(|f| (f, value))
}

/// Whether a word after a flag of [`Takes::MaybeValue`] is its value rather than the next flag.
fn is_value(word: &str) -> bool {
    !word.starts_with('-') || word.parse::<f64>().is_ok()
}

/// `hmoe serve`'s command line as clap reads it, and the notes for what does not apply.
#[derive(Debug, Default, PartialEq)]
pub struct ServeArgv {
    /// The words for clap, hmoe's spellings.
    pub args: Vec<String>,
    /// One line per flag that does not apply: `--numa does not apply to hmoe serve (…); ignored`.
    pub notes: Vec<String>,
}

/// Rewrites the words after `serve` (see the module's documentation): `env` reads a variable.
/// A word no row names passes to clap unchanged (hmoe's own flags, or a mistake clap reports).
/// A variable that is set but not usable (`LLAMA_ARG_MMAP=maybe`) is an error.
pub fn rewrite_serve(
    words: &[String],
    env: impl Fn(&str) -> Option<String>,
) -> Result<ServeArgv, String> {
    let on_command_line: Vec<&'static str> = words
        .iter()
        .filter_map(|w| lookup(w))
        .filter_map(|(f, _)| f.env.name())
        .collect();
    let mut out = ServeArgv::default();
    let mut noted: Vec<&'static str> = Vec::new();
    for (var, flag, values) in env_flags(&on_command_line, &env)? {
        let name = flag.long_name();
        apply_values(&mut out, &mut noted, flag, name, values, Some(var));
    }
    let mut i = 0;
    while i < words.len() {
        let word = &words[i];
        i += 1;
        let Some((flag, inline)) = lookup(word) else {
            out.args.push(word.clone());
            continue;
        };
        let values: Vec<String> = match (flag.takes, inline) {
            (_, Some(v)) => vec![v.to_string()],
            (Takes::Nothing, None) => vec![],
            (Takes::MaybeValue, None) => match words.get(i) {
                Some(w) if is_value(w) => {
                    i += 1;
                    vec![w.clone()]
                }
                _ => vec![],
            },
            (Takes::Value, None) | (Takes::TwoValues, None) => {
                let n = if flag.takes == Takes::Value { 1 } else { 2 };
                let taken = words[i..].iter().take(n).cloned().collect::<Vec<_>>();
                i += taken.len();
                taken
            }
        };
        let name = word.split_once('=').map_or(word.as_str(), |(n, _)| n);
        apply_values(&mut out, &mut noted, flag, name, values, None);
    }
    Ok(out)
}

/// A flag the environment sets: the variable, the flag, its values.
type EnvFlag = (String, &'static LlamaFlag, Vec<String>);

/// The flags the environment sets: `(variable, flag, values)` for each row whose variable is
/// set (`HMOE_…` before `LLAMA_…`), unless a flag of the same variable is on the command line.
/// Only `LLAMA_*` variables are read (not `HF_TOKEN`, which other tools share).
fn env_flags(
    on_command_line: &[&str],
    env: &impl Fn(&str) -> Option<String>,
) -> Result<Vec<EnvFlag>, String> {
    let mut out = Vec::new();
    for flag in LLAMA_SERVER_FLAGS {
        let Some(name) = flag.env.name() else {
            continue;
        };
        let Some(rest) = name.strip_prefix("LLAMA_") else {
            continue;
        };
        if on_command_line.contains(&name) {
            continue;
        }
        let hmoe_name = format!("HMOE_{rest}");
        let Some((var, value)) = (env(&hmoe_name).map(|v| (hmoe_name, v)))
            .or_else(|| env(name).map(|v| (name.to_string(), v)))
        else {
            continue;
        };
        let truth = match value.trim().to_ascii_lowercase().as_str() {
            "1" | "true" | "on" | "enabled" => Some(true),
            "0" | "false" | "off" | "disabled" => Some(false),
            _ => None,
        };
        match (flag.env, truth) {
            (Env::Value(_), _) => out.push((var, flag, vec![value])),
            (Env::IfTrue(_), Some(true)) | (Env::IfFalse(_), Some(false)) => {
                out.push((var, flag, Vec::new()))
            }
            (Env::IfTrue(_) | Env::IfFalse(_), Some(_)) | (Env::No, _) => {}
            (Env::IfTrue(_) | Env::IfFalse(_), None) => {
                return Err(format!(
                    "{var}={value}: expected 1/0, true/false, on/off or enabled/disabled"
                ))
            }
        }
    }
    Ok(out)
}

/// Rewrites one flag and its values, or notes it.
fn apply_values(
    out: &mut ServeArgv,
    noted: &mut Vec<&'static str>,
    flag: &'static LlamaFlag,
    name: &str,
    mut values: Vec<String>,
    from_env: Option<String>,
) {
    match flag.does {
        Does::Hmoe(long) => {
            if flag.takes == Takes::MaybeValue && values.is_empty() {
                // A bare `-fa`, `-fit` or `--reasoning` means on.
                values.push("on".into());
            }
            out.args.push(long.to_string());
            out.args.extend(values);
        }
        Does::Always => {}
        Does::Note(why) => {
            let long = flag.long_name();
            if !noted.contains(&long) {
                noted.push(long);
                let given = match (&from_env, name == long) {
                    (Some(var), _) => format!("{long} (from {var})"),
                    (None, true) => long.to_string(),
                    (None, false) => format!("{long} ({name})"),
                };
                out.notes.push(format!(
                    "{given} does not apply to hmoe serve ({why}); ignored"
                ));
            }
        }
    }
}

/// For the commands other than `serve`: llama.cpp's multi-letter single-dash spellings of the
/// flags hmoe implements (`-ngl`, `-fa`, `-ctk`, …) become hmoe's long spellings; every other
/// word is left as it is.
pub fn rewrite_short_flags(words: impl Iterator<Item = String>) -> Vec<String> {
    words
        .map(|w| {
            let multi_letter_short = w.len() > 2 && w.starts_with('-') && !w.starts_with("--");
            match lookup(&w) {
                Some((flag, _)) if multi_letter_short => match flag.does {
                    Does::Hmoe(long) => long.to_string(),
                    _ => w,
                },
                _ => w,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests;
