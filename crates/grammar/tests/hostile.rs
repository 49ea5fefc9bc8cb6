//! Hostile grammars and schemas: deep rule and `$ref` chains compile (on the compiler's own
//! stack, whatever the caller's), nesting, size and terminal counts beyond the limits are
//! refused at once with a message naming the limit, grammars that allow nothing are refused at
//! compile time with one short line, and random grammars and schemas never panic or hang.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use hmoe_gguf::{GgufModel, LoadOptions};
use hmoe_grammar::limits::{
    MAX_ALTERNATIVES, MAX_GRAMMAR_BYTES, MAX_NESTING, MAX_RULES, MAX_TERMINALS, MAX_TOOLS,
};
use hmoe_grammar::{gbnf_to_lark, Frame, Grammar, GrammarError, Tool, ToolFormat, Vocab};
use hmoe_tokenizer::Tokenizer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Map, Value};

fn vocab() -> Arc<Vocab> {
    static BUILT: OnceLock<Arc<Vocab>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let dir = hmoe_testdata::fixtures();
            let g = GgufModel::open(dir.join("tokenizer/vocab-1k.gguf"), LoadOptions::default())
                .expect("fixture");
            let tok = Arc::new(Tokenizer::from_metadata(g.metadata()).expect("tokenizer"));
            Arc::new(Vocab::new(&tok).unwrap())
        })
        .clone()
}

/// `{"$defs": {d0: {$ref: d1}, …, dn: {type: string}}, "$ref": "#/$defs/d0"}`.
fn ref_chain(n: usize) -> Value {
    let mut defs = Map::new();
    for i in 0..n {
        defs.insert(
            format!("d{i}"),
            json!({"$ref": format!("#/$defs/d{}", i + 1)}),
        );
    }
    defs.insert(format!("d{n}"), json!({"type": "string"}));
    json!({"$defs": defs, "$ref": "#/$defs/d0"})
}

/// GBNF `root ::= r0`, `r0 ::= r1`, …, `rn ::= "x"`.
fn rule_chain(n: usize) -> String {
    let mut s = String::from("root ::= r0\n");
    for i in 0..n {
        s += &format!("r{i} ::= r{}\n", i + 1);
    }
    s + &format!("r{n} ::= \"x\"\n")
}

/// GBNF `root ::= "w0" | … | "w{n-1}"`.
fn alternatives(n: usize) -> String {
    let alts: Vec<String> = (0..n).map(|i| format!("\"w{i}\"")).collect();
    format!("root ::= {}", alts.join(" | "))
}

fn compile(g: &Grammar) -> Result<(), GrammarError> {
    vocab().compile(g, Frame::Raw).map(|_| ())
}

/// A message a client may see: one line, short, no backtrace or source path.
fn assert_short(e: &GrammarError) {
    let m = e.to_string();
    assert!(m.len() < 400 && !m.contains('\n'), "{m}");
    assert!(!m.contains(".rs:") && !m.contains("backtrace"), "{m}");
}

#[test]
fn deep_ref_and_rule_chains_compile_on_a_small_caller_stack() {
    // Test threads have 2 MiB stacks: the compiler's own thread carries the recursion.
    for n in [1000, 30_000] {
        compile(&Grammar::JsonSchema(ref_chain(n))).unwrap_or_else(|e| panic!("{n}: {e}"));
        compile(&Grammar::Gbnf(rule_chain(n))).unwrap_or_else(|e| panic!("{n}: {e}"));
        let lark = rule_chain(n)
            .replace(" ::= ", ": ")
            .replace("root", "start");
        compile(&Grammar::Lark(lark)).unwrap_or_else(|e| panic!("{n}: {e}"));
    }
}

#[test]
fn rules_beyond_the_limit_are_refused_naming_it() {
    let e = compile(&Grammar::Gbnf(rule_chain(MAX_RULES + 10))).unwrap_err();
    assert!(e.to_string().contains(&format!("{MAX_RULES} rules")), "{e}");
    let lark = rule_chain(MAX_RULES + 10)
        .replace(" ::= ", ": ")
        .replace("root", "start");
    let e = compile(&Grammar::Lark(lark)).unwrap_err();
    assert!(e.to_string().contains(&format!("{MAX_RULES} rules")), "{e}");
}

#[test]
fn nesting_beyond_the_limit_is_refused_naming_it() {
    let deep = |n: usize| format!("root ::= {}\"a\"{}", "(".repeat(n), ")".repeat(n));
    gbnf_to_lark(&deep(MAX_NESTING)).unwrap();
    for n in [MAX_NESTING + 1, 5000, 200_000] {
        let e = gbnf_to_lark(&deep(n)).unwrap_err();
        assert!(e.message.contains(&format!("{MAX_NESTING} levels")), "{e}");
    }
    // Repetitions nest too (each is a group in the Lark text); a long run is no quadratic copy.
    let e = gbnf_to_lark(&format!("root ::= \"a\"{}", "*".repeat(500_000))).unwrap_err();
    assert!(e.message.contains(&format!("{MAX_NESTING} levels")), "{e}");
    let e = compile(&Grammar::Gbnf(deep(5000))).unwrap_err();
    assert_short(&e);
}

#[test]
fn big_grammars_are_refused_within_a_second() {
    for (n, limit) in [
        (500_000, format!("{MAX_GRAMMAR_BYTES} bytes")),
        (100_000, format!("{MAX_GRAMMAR_BYTES} bytes")),
        (MAX_TERMINALS + 1, format!("{MAX_TERMINALS} terminals")),
    ] {
        let t0 = Instant::now();
        let e = compile(&Grammar::Gbnf(alternatives(n))).unwrap_err();
        assert!(
            t0.elapsed() < Duration::from_secs(1),
            "{n}: {:?}",
            t0.elapsed()
        );
        assert!(e.to_string().contains(&limit), "{n}: {e}");
        assert_short(&e);
    }
    let big =
        json!({"enum": (0..100_000).map(|i| format!("value number {i}")).collect::<Vec<_>>()});
    let e = compile(&Grammar::JsonSchema(big)).unwrap_err();
    assert!(e.to_string().contains("bytes"), "{e}");
    let lark = format!(
        "start: {}",
        (0..MAX_TERMINALS + 1)
            .map(|i| format!("\"w{i}\""))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    let e = compile(&Grammar::Lark(lark)).unwrap_err();
    assert!(e.to_string().contains("terminals"), "{e}");
}

#[test]
fn alternatives_beyond_the_limit_are_refused_naming_it() {
    let same = |n: usize| format!("root ::= a{}\na ::= \"x\"\n", " | a".repeat(n));
    for n in [MAX_ALTERNATIVES + 1, 200_000] {
        let t0 = Instant::now();
        let e = compile(&Grammar::Gbnf(same(n))).unwrap_err();
        assert!(
            t0.elapsed() < Duration::from_secs(1),
            "{n}: {:?}",
            t0.elapsed()
        );
        assert!(
            e.to_string()
                .contains(&format!("{MAX_ALTERNATIVES} alternatives")),
            "{e}"
        );
        let lark = same(n).replace(" ::= ", ": ").replace("root", "start");
        let e = compile(&Grammar::Lark(lark)).unwrap_err();
        assert!(
            e.to_string()
                .contains(&format!("{MAX_ALTERNATIVES} alternatives")),
            "{e}"
        );
    }
}

#[test]
fn grammars_at_the_limits_compile_in_seconds() {
    let t0 = Instant::now();
    compile(&Grammar::Gbnf(alternatives(MAX_TERMINALS))).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

#[test]
fn grammars_that_allow_nothing_are_refused_with_one_short_line() {
    for schema in [
        json!({"$ref": "#"}),
        json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
    ] {
        let e = compile(&Grammar::JsonSchema(schema.clone())).unwrap_err();
        assert!(matches!(e, GrammarError::Invalid(_)), "{schema}: {e:?}");
        assert!(e.to_string().contains("allows no output"), "{e}");
        assert_short(&e);
    }
    let e = compile(&Grammar::Lark("start: start \"a\"\n".into())).unwrap_err();
    assert_short(&e);
}

#[test]
fn engine_errors_are_one_short_line() {
    // llguidance's own message for an unknown schema reference carries the grammar.
    for g in [
        Grammar::JsonSchema(json!({"$ref": "#/$defs/missing"})),
        Grammar::Lark(format!("start: {}\"a\"{}", "(".repeat(40), ")".repeat(40))),
        Grammar::Lark("start: x\nx: /(/\n".into()),
        Grammar::JsonSchema(json!({"type": "object", "properties": {"a": {"type": "nope"}}})),
    ] {
        match compile(&g) {
            Ok(()) => {}
            Err(e) => assert_short(&e),
        }
    }
}

/// A random GBNF-ish text: mostly valid pieces (rules, literals, classes, groups,
/// repetitions), with random bytes mixed in.
fn random_gbnf(rng: &mut StdRng) -> String {
    const PIECES: [&str; 24] = [
        "root", " ::= ", "a", "b", "\"x\"", "\"\\n\"", "[a-z]", "[^\"]", ".", "(", ")", "|", "*",
        "+", "?", "{2}", "{1,3}", "{,4}", "\n", " ", "<|end|>", "# c\n", "\\", "\"",
    ];
    let mut s = String::from("root ::= ");
    for _ in 0..rng.random_range(0..40) {
        if rng.random_bool(0.05) {
            s.push(rng.random_range(0u8..128) as char);
        } else {
            s.push_str(PIECES[rng.random_range(0..PIECES.len())]);
        }
    }
    if rng.random_bool(0.5) {
        s.push_str("\na ::= \"a\" | b\nb ::= [0-9]+ a?\n");
    }
    s
}

/// A random JSON schema nested up to `depth` deep: types, objects, arrays, combinators,
/// `$ref`s (cycles included), numbers and string bounds.
fn random_schema(rng: &mut StdRng, depth: usize) -> Value {
    let leaf = |rng: &mut StdRng| match rng.random_range(0..9) {
        0 => json!({"type": "string", "maxLength": rng.random_range(0..20)}),
        1 => {
            json!({"type": "integer", "minimum": rng.random_range(-5..5), "maximum": rng.random_range(-5..50)})
        }
        2 => json!({"type": "number"}),
        3 => json!({"type": "boolean"}),
        4 => json!({"enum": ["a", 1, null]}),
        5 => json!({"const": "k"}),
        6 => json!({"$ref": "#"}),
        7 => json!({"$ref": "#/$defs/x"}),
        _ => json!({"type": "string", "pattern": "^[a-c]{1,3}$"}),
    };
    if depth == 0 || rng.random_bool(0.3) {
        return leaf(rng);
    }
    let sub = |rng: &mut StdRng| random_schema(rng, depth - 1);
    match rng.random_range(0..6) {
        0 => {
            let props: Map<String, Value> = (0..rng.random_range(0..4))
                .map(|i| (format!("p{i}"), sub(rng)))
                .collect();
            let required: Vec<&String> = props.keys().filter(|_| rng.random_bool(0.5)).collect();
            json!({"type": "object", "properties": props, "required": required,
                   "additionalProperties": rng.random_bool(0.5)})
        }
        1 => json!({"type": "array", "items": sub(rng), "minItems": rng.random_range(0..3),
                     "maxItems": rng.random_range(0..5)}),
        2 => json!({"anyOf": [sub(rng), sub(rng)]}),
        3 => json!({"oneOf": [sub(rng), sub(rng), sub(rng)]}),
        4 => json!({"allOf": [sub(rng), sub(rng)]}),
        _ => json!({"$defs": {"x": sub(rng)}, "$ref": "#/$defs/x"}),
    }
}

/// Random grammars and schemas: the translator and the compiler return (never panic, never
/// overflow), within seconds each, with short messages. `HMOE_FUZZ_CASES` sets how many
/// (default 300, a few seconds); every tenth is compiled whole, the rest only translated.
#[test]
fn random_grammars_and_schemas_never_panic_or_hang() {
    let cases: usize = std::env::var("HMOE_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    let seed: u64 = std::env::var("HMOE_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(47);
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut ok, mut refused) = (0usize, 0usize);
    for i in 0..cases {
        let grammar = match i % 2 {
            0 => Grammar::Gbnf(random_gbnf(&mut rng)),
            _ => Grammar::JsonSchema(random_schema(&mut rng, 6)),
        };
        let t0 = Instant::now();
        let result = match (i / 2) % 10 {
            0 => compile(&grammar),
            _ => vocab().lark(&grammar, Frame::Raw).map(|_| ()),
        };
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "{grammar:?}: {:?}",
            t0.elapsed()
        );
        match result {
            Ok(()) => ok += 1,
            Err(e) => {
                assert_short(&e);
                refused += 1;
            }
        }
    }
    eprintln!("{cases} random grammars and schemas: {ok} accepted, {refused} refused");
    assert!(ok > 0 && refused > 0, "{ok} accepted, {refused} refused");
}

#[test]
fn tool_lists_beyond_the_limit_are_refused_naming_it() {
    let tools = |n: usize| Grammar::ToolCall {
        format: ToolFormat::ToolCallTags,
        tools: (0..n)
            .map(|i| Tool {
                name: format!("f{i}"),
                parameters: None,
            })
            .collect(),
    };
    compile(&tools(8)).unwrap();
    let t0 = Instant::now();
    let e = compile(&tools(20_000)).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    assert!(e.to_string().contains(&format!("{MAX_TOOLS} tools")), "{e}");
}

/// Costly shapes within the limits: many rule references, nested repetitions, a regex of a
/// million characters, 20,000 optional terminals in a row, 20,000 wide character classes.
#[test]
fn costly_shapes_within_the_limits_end_well_before_the_deadline() {
    let refs: String = (0..50_000).map(|i| format!("r{} ", i % 20_000)).collect();
    let mut many = format!("root ::= {refs}\n");
    for i in 0..20_000 {
        many += &format!("r{i} ::= \"x\" | r{}\n", (i * 7 + 1) % 20_000);
    }
    let class = |i: u32| char::from_u32(0x100 + i).unwrap();
    let classes: Vec<String> = (0..20_000)
        .map(|i| format!("[{}-{}]", class(i), class(i + 5000)))
        .collect();
    let optional: Vec<String> = (0..20_000).map(|i| format!("\"w{i}\"?")).collect();
    let same = format!(
        "root ::= a{}\na ::= \"x\"\n",
        " | a".repeat(MAX_ALTERNATIVES)
    );
    let mut distinct = String::from("root ::= r0");
    for i in 1..MAX_ALTERNATIVES {
        distinct += &format!(" | r{i}");
    }
    for i in 0..MAX_ALTERNATIVES {
        distinct += &format!("\nr{i} ::= \"x\"");
    }
    for (what, g) in [
        ("references", Grammar::Gbnf(many)),
        (
            "repetitions",
            Grammar::Gbnf("root ::= (((\"a\"{1000}){1000}){1000})".into()),
        ),
        (
            "pattern",
            Grammar::JsonSchema(json!({"type": "string", "pattern": "^(a{1000}){1000}$"})),
        ),
        (
            "classes",
            Grammar::Gbnf(format!("root ::= {}", classes.join(" | "))),
        ),
        (
            "optional",
            Grammar::Gbnf(format!("root ::= {}", optional.join(" "))),
        ),
        ("same alternatives", Grammar::Gbnf(same)),
        ("rule alternatives", Grammar::Gbnf(distinct)),
    ] {
        let t0 = Instant::now();
        if let Err(e) = compile(&g) {
            assert_short(&e);
            assert!(!matches!(e, GrammarError::Limit(_)), "{what}: {e}");
        }
        assert!(
            t0.elapsed() < Duration::from_secs(8),
            "{what}: {:?}",
            t0.elapsed()
        );
    }
}

/// The longest `$ref` chain that fits the byte limit (three-character names) compiles.
#[test]
fn the_longest_ref_chain_within_the_byte_limit_compiles() {
    let name = |i: usize| {
        const A: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
        let (a, b, c) = (i % 62, (i / 62) % 62, i / 3844);
        format!("{}{}{}", A[a] as char, A[b] as char, A[c] as char)
    };
    let n = 36_000;
    let mut defs = Map::new();
    for i in 0..n {
        defs.insert(name(i), json!({"$ref": format!("#/$defs/{}", name(i + 1))}));
    }
    defs.insert(name(n), json!({"type": "string"}));
    let g = Grammar::JsonSchema(json!({"$defs": defs, "$ref": format!("#/$defs/{}", name(0))}));
    assert!(g.size() <= MAX_GRAMMAR_BYTES, "{}", g.size());
    compile(&g).unwrap();
}
