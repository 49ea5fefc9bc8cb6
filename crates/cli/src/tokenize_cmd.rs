//! `hmoe tokenize`: tokenize text with a model's vocabulary and print the tokens like
//! llama.cpp's `llama-tokenize`.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;
use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_tokenizer::Tokenizer;

/// Arguments of `hmoe tokenize`.
#[derive(clap::Args)]
pub struct TokenizeArgs {
    /// Model file (only its vocabulary metadata is read; for a split model, the first shard).
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// The text to tokenize (or use --prompt, --file or --stdin).
    pub text: Option<String>,
    /// The text to tokenize.
    #[arg(short = 'p', long = "prompt", conflicts_with_all = ["text", "file", "stdin"])]
    pub prompt: Option<String>,
    /// Read the text from a file (bytes as they are).
    #[arg(short = 'f', long = "file", conflicts_with_all = ["text", "stdin"])]
    pub file: Option<PathBuf>,
    /// Read the text from standard input.
    #[arg(long, conflicts_with = "text")]
    pub stdin: bool,
    /// Do not add BOS (by default BOS/EOS are added when the model's metadata says so).
    #[arg(long)]
    pub no_bos: bool,
    /// Turn the text of control tokens (e.g. `<|start|>`) into those tokens.
    #[arg(long)]
    pub parse_special: bool,
    /// Print only the ids, as one JSON array.
    #[arg(long)]
    pub ids: bool,
    /// Do not process escapes (`\n`, `\t`, `\\`, `\xHH`, ...) in the text.
    #[arg(long)]
    pub no_escape: bool,
    /// Print the number of tokens at the end.
    #[arg(long)]
    pub show_count: bool,
}

/// Tokenizes the text and prints the result.
pub fn run(args: TokenizeArgs) -> anyhow::Result<()> {
    let raw: Vec<u8> = if let Some(t) = args.text.as_ref().or(args.prompt.as_ref()) {
        t.clone().into_bytes()
    } else if let Some(f) = &args.file {
        std::fs::read(f).with_context(|| format!("reading {}", f.display()))?
    } else if args.stdin {
        let mut buf = Vec::new();
        std::io::stdin()
            .read_to_end(&mut buf)
            .context("reading standard input")?;
        buf
    } else {
        anyhow::bail!("no text given: pass TEXT, --prompt, --file or --stdin");
    };
    let bytes = if args.no_escape {
        raw
    } else {
        process_escapes(&raw)
    };
    let text = String::from_utf8_lossy(&bytes);

    let (tok, ids) = tokenize(&args.model, &text, args.no_bos, args.parse_special)?;

    let mut out = std::io::stdout().lock();
    out.write_all(render(&tok, &ids, args.ids).as_slice())?;
    if args.show_count {
        writeln!(out, "Total number of tokens: {}", ids.len())?;
    }
    Ok(())
}

/// Loads the vocabulary of `model` and tokenizes `text` as llama-tokenize does: BOS (and EOS,
/// when the model adds one) exactly when the metadata says so and `no_bos` is not set.
fn tokenize(
    model: &Path,
    text: &str,
    no_bos: bool,
    parse_special: bool,
) -> anyhow::Result<(Tokenizer, Vec<u32>)> {
    let gguf = GgufModel::open(model, LoadOptions::default())
        .with_context(|| format!("opening {}", model.display()))?;
    let tok = Tokenizer::from_metadata(gguf.metadata())
        .with_context(|| format!("building the tokenizer of {}", model.display()))?;
    let add_special = tok.add_bos() && !no_bos;
    let ids = tok.encode(text, add_special, parse_special)?;
    Ok((tok, ids))
}

/// llama-tokenize's output: `[1, 2, 3]` with `--ids`, else one `%6d -> 'piece'` line per token
/// (pieces written as raw bytes).
fn render(tok: &Tokenizer, ids: &[u32], only_ids: bool) -> Vec<u8> {
    let mut out = Vec::new();
    if only_ids {
        let list: Vec<String> = ids.iter().map(u32::to_string).collect();
        out.extend_from_slice(format!("[{}]\n", list.join(", ")).as_bytes());
        return out;
    }
    for &id in ids {
        out.extend_from_slice(format!("{id:6} -> '").as_bytes());
        out.extend_from_slice(tok.token_bytes(id));
        out.extend_from_slice(b"'\n");
    }
    out
}

/// llama.cpp's `string_process_escapes`: `\n \r \t \' \" \\` and `\xHH`; any other escape is
/// kept as written.
fn process_escapes(input: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(input.len());
    let mut i = 0;
    while i < input.len() {
        if input[i] == b'\\' && i + 1 < input.len() {
            i += 1;
            match input[i] {
                b'n' => out.push(b'\n'),
                b'r' => out.push(b'\r'),
                b't' => out.push(b'\t'),
                b'\'' => out.push(b'\''),
                b'"' => out.push(b'"'),
                b'\\' => out.push(b'\\'),
                b'x' if i + 2 < input.len()
                    && input[i + 1].is_ascii_hexdigit()
                    && input[i + 2].is_ascii_hexdigit() =>
                {
                    let hex = std::str::from_utf8(&input[i + 1..i + 3]).unwrap_or("00");
                    out.push(u8::from_str_radix(hex, 16).unwrap_or(0));
                    i += 2;
                }
                other => {
                    out.push(b'\\');
                    out.push(other);
                }
            }
        } else {
            out.push(input[i]);
        }
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    use hmoe_testdata::fixture;

    #[test]
    fn prints_like_llama_tokenize() {
        let model = fixture("tokenizer/ggml-vocab-llama-bpe.gguf");
        let (tok, ids) = tokenize(&model, "Hello world", false, false).unwrap();
        assert_eq!(render(&tok, &ids, true), b"[128000, 9906, 1917]\n");
        assert_eq!(
            String::from_utf8(render(&tok, &ids, false)).unwrap(),
            "128000 -> '<|begin_of_text|>'\n  9906 -> 'Hello'\n  1917 -> ' world'\n"
        );
        let (_, ids) = tokenize(&model, "Hello world", true, false).unwrap();
        assert_eq!(ids, [9906, 1917]);
        // o200k (gpt-oss) does not add BOS; control tokens only with --parse-special.
        let model = fixture("tokenizer/ggml-vocab-o200k-harmony.gguf");
        let (tok, ids) = tokenize(&model, "<|return|>", false, true).unwrap();
        assert_eq!(render(&tok, &ids, true), b"[200002]\n");
        let (_, ids) = tokenize(&model, "<|return|>", false, false).unwrap();
        assert!(ids.len() > 1);
    }

    #[test]
    fn escapes_like_llama_cpp() {
        assert_eq!(process_escapes(br"a\nb\tc\\d\x41\q\"), b"a\nb\tc\\dA\\q\\");
        assert_eq!(process_escapes(br"\x4"), b"\\x4");
        assert_eq!(process_escapes(br#"\'\""#), b"'\"");
    }
}
