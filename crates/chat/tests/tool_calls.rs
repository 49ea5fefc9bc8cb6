//! Tool calls of the Qwen3, Qwen3-Coder and DeepSeek formats read back from the exact text their
//! fixture templates teach (an assistant turn with calls rendered, minus the generation prompt),
//! whole and streamed in pieces; malformed calls come back as content.

mod common;

use common::template;
use std::sync::Arc;

use hmoe_chat::{
    render_template, ChatDelta, ReasoningFormat, ThinkSplitter, ToolCallFormat, ToolCallParser,
    ToolCallSpec, MAX_HELD,
};
use serde_json::{json, Value};

fn tools() -> Value {
    json!([{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "opts": {"type": "object"}, "note": {"type": ["string", "null"]}},
            "required": ["city"]}}},
        {"type": "function", "function": {"name": "get_time", "description": "Time.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}])
}

/// The calls the assistant turn makes (arguments as objects, as the server hands them to
/// templates).
fn calls() -> Vec<(String, Value)> {
    vec![
        (
            "get_weather".into(),
            json!({"city": "Paris", "days": 3, "opts": {"metric": true}, "note": "12"}),
        ),
        ("get_time".into(), json!({"zone": "Europe/Paris"})),
    ]
}

#[derive(Debug, Default, PartialEq)]
struct Read {
    reasoning: String,
    content: String,
    calls: Vec<(String, Value)>,
}

/// Runs text through `<think>` splitting and the tool-call reader, in `chunks`.
fn read(spec: &Arc<ToolCallSpec>, think_open: bool, chunks: &[&str]) -> Read {
    let mut think = ThinkSplitter::new(ReasoningFormat::Auto, think_open.then_some("<think>"));
    let mut parser = ToolCallParser::new(spec.clone());
    let mut routed = Vec::new();
    for c in chunks {
        for d in think.push(c) {
            match d {
                ChatDelta::Content(t) => routed.extend(parser.push(&t)),
                other => routed.push(other),
            }
        }
    }
    for d in think.finish() {
        match d {
            ChatDelta::Content(t) => routed.extend(parser.push(&t)),
            other => routed.push(other),
        }
    }
    routed.extend(parser.finish());
    let mut out = Read::default();
    let mut args: Vec<String> = Vec::new();
    for r in routed {
        match r {
            ChatDelta::Reasoning(t) => out.reasoning.push_str(&t),
            ChatDelta::Content(t) => out.content.push_str(&t),
            ChatDelta::ToolCallStart { index, name } => {
                assert_eq!(index, out.calls.len());
                out.calls.push((name, Value::Null));
                args.push(String::new());
            }
            ChatDelta::ToolCallArgs { index, delta } => args[index].push_str(&delta),
        }
    }
    for (c, a) in out.calls.iter_mut().zip(&args) {
        c.1 = serde_json::from_str(a).unwrap_or_else(|e| panic!("{e}: {a}"));
    }
    out
}

/// Reading `text` whole equals reading it one character at a time and in two pieces split at
/// every character boundary.
fn read_every_way(spec: &Arc<ToolCallSpec>, think_open: bool, text: &str) -> Read {
    let whole = read(spec, think_open, &[text]);
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(
        read(spec, think_open, &refs),
        whole,
        "char by char: {text:?}"
    );
    for (i, _) in text.char_indices().skip(1) {
        let (a, b) = text.split_at(i);
        assert_eq!(
            read(spec, think_open, &[a, b]),
            whole,
            "split at {i}: {text:?}"
        );
    }
    whole
}

/// What the model is taught to write for an assistant turn with `content` and the calls:
/// the turn rendered after the conversation, past the generation prompt, without the
/// end-of-turn markup; and whether the generation prompt opened `<think>`.
fn taught(src: &str, name: &str, content: &str, end: &str) -> (String, bool) {
    let user = json!([{"role": "user", "content": "Weather in Paris?"}]);
    let tool_calls: Vec<Value> = calls()
        .into_iter()
        .enumerate()
        .map(|(i, (n, a))| json!({"id": format!("call_{i}"), "type": "function", "function": {"name": n, "arguments": a}}))
        .collect();
    let mut with_turn = user.clone();
    with_turn
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "assistant", "content": content, "tool_calls": tool_calls}));
    let extra =
        json!({"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"});
    let prompt = render_template(src, &user, Some(&tools()), true, &extra).unwrap();
    let full = render_template(src, &with_turn, Some(&tools()), false, &extra).unwrap();
    // Templates that drop the generation prompt's `<think>` from history (DeepSeek R1) are cut
    // after the last assistant marker instead.
    let (turn, think_open) = match full.strip_prefix(prompt.as_str()) {
        Some(t) => (t, prompt.trim_end().ends_with("<think>")),
        None => {
            let marker = "<｜Assistant｜>";
            let at = prompt.rfind(marker).expect("an assistant marker") + marker.len();
            let t = full
                .strip_prefix(&prompt[..at])
                .unwrap_or_else(|| panic!("{name}: the turn does not follow the prompt"));
            (t, false)
        }
    };
    let cut = turn
        .find(end)
        .unwrap_or_else(|| panic!("{name}: {turn:?} does not end in {end}"));
    (turn[..cut].trim_end().to_string(), think_open)
}

fn check_template(name: &str, format: ToolCallFormat, end: &str) {
    check_source(&template(name), name, format, end);
}

/// [`check_template`] on template text `src`.
fn check_source(src: &str, name: &str, format: ToolCallFormat, end: &str) {
    assert_eq!(ToolCallFormat::detect(src), Some(format), "{name}");
    let spec = Arc::new(ToolCallSpec::new(format, Some(&tools()), true));
    for content in ["Let me check.", ""] {
        let (text, think_open) = taught(src, name, content, end);
        let got = read_every_way(&spec, think_open, &text);
        assert_eq!(got.calls, calls(), "{name}: {text:?}");
        // DeepSeek R1 and hmoe's Llama 3 templates drop the content of a tool-call turn;
        // Mistral's puts a space before it.
        let shown = if text.contains(content) { content } else { "" };
        assert_eq!(got.content.trim_start(), shown, "{name}: {text:?}");
    }
}

#[test]
fn qwen3_hermes_calls_round_trip() {
    check_template(
        "Qwen-Qwen3-0.6B.jinja",
        ToolCallFormat::Hermes,
        "<|im_end|>",
    );
}

#[test]
fn qwen3_coder_xml_calls_round_trip_with_typed_values() {
    check_template(
        "Qwen3-Coder.jinja",
        ToolCallFormat::Qwen3Coder,
        "<|im_end|>",
    );
    // A string-typed parameter stays a string even when it reads as a number.
    let spec = Arc::new(ToolCallSpec::new(
        ToolCallFormat::Qwen3Coder,
        Some(&tools()),
        true,
    ));
    let r = read(
        &spec,
        false,
        &["<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\nsoon\n</parameter>\n</function>\n</tool_call>"],
    );
    assert_eq!(
        r.calls,
        vec![(
            "get_weather".to_string(),
            json!({"city": "42", "days": "soon"})
        )]
    );
}

#[test]
fn deepseek_v3_1_calls_round_trip() {
    check_template(
        "deepseek-ai-DeepSeek-V3.1.jinja",
        ToolCallFormat::DeepSeek,
        "<｜end▁of▁sentence｜>",
    );
}

#[test]
fn deepseek_r1_calls_round_trip() {
    check_template(
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
        ToolCallFormat::DeepSeek,
        "<｜end▁of▁sentence｜>",
    );
    assert_eq!(
        ToolCallFormat::detect(&template("llama-cpp-deepseek-r1.jinja")),
        Some(ToolCallFormat::DeepSeek)
    );
    assert_eq!(
        ToolCallFormat::detect(&template("openai-gpt-oss-120b.jinja")),
        None
    );
}

#[test]
fn reasoning_then_calls() {
    let spec = Arc::new(ToolCallSpec::new(
        ToolCallFormat::Hermes,
        Some(&tools()),
        true,
    ));
    let text = "<think>\nCall it.\n</think>\n\nOne moment.\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
    let r = read_every_way(&spec, false, text);
    assert_eq!(r.reasoning, "\nCall it.\n");
    assert_eq!(r.content, "One moment.");
    assert_eq!(r.calls, vec![("get_time".to_string(), json!({}))]);
}

#[test]
fn content_before_a_call_streams_and_the_call_is_held_back() {
    let spec = Arc::new(ToolCallSpec::new(ToolCallFormat::Hermes, None, true));
    let mut p = ToolCallParser::new(spec);
    assert_eq!(p.push("Sure "), vec![ChatDelta::Content("Sure".into())]);
    assert_eq!(
        p.push("thing.\n<tool"),
        vec![ChatDelta::Content(" thing.".into())]
    );
    assert!(p
        .push("_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_")
        .is_empty());
    assert_eq!(
        p.push("call>\n"),
        vec![
            ChatDelta::ToolCallStart {
                index: 0,
                name: "f".into()
            },
            ChatDelta::ToolCallArgs {
                index: 0,
                delta: "{\"a\":1}".into()
            },
        ]
    );
    assert!(p.finish().is_empty());
    assert_eq!(p.n_calls(), 1);
}

#[test]
fn malformed_calls_come_back_as_content() {
    let spec = Arc::new(ToolCallSpec::new(ToolCallFormat::Hermes, None, true));
    let cases = [
        // Not JSON.
        "Hi <tool_call>\n{not json}\n</tool_call> bye",
        // No name.
        "<tool_call>{\"arguments\": {}}</tool_call>",
        // Arguments that are not an object.
        "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>",
        // Unterminated and incomplete.
        "<tool_call>\n{\"name\": \"f\", \"argu",
        // A partial tag at the end.
        "text <tool_ca",
        // XML without its end.
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>",
    ];
    for text in cases {
        let r = read_every_way(&spec, false, text);
        assert!(r.calls.is_empty(), "{text:?}: {r:?}");
        assert_eq!(
            r.content,
            text.replace("Hi <", "Hi<").trim_start(),
            "{text:?}"
        );
    }
    // A good call after a bad one is still read.
    let text = "<tool_call>oops</tool_call><tool_call>{\"name\": \"g\"}</tool_call>";
    let r = read_every_way(&spec, false, text);
    assert_eq!(r.content, "<tool_call>oops</tool_call>");
    assert_eq!(r.calls, vec![("g".to_string(), json!({}))]);
    // A complete call whose end tag never came is taken (the model stopped after it).
    let r = read(
        &spec,
        false,
        &["<tool_call>{\"name\": \"g\", \"arguments\": {\"x\": 2}}"],
    );
    assert_eq!(r.calls, vec![("g".to_string(), json!({"x": 2}))]);
    // DeepSeek: a block that holds no call.
    let ds = Arc::new(ToolCallSpec::new(ToolCallFormat::DeepSeek, None, true));
    let text = "A<｜tool▁calls▁begin｜>nothing<｜tool▁calls▁end｜>";
    let r = read_every_way(&ds, false, text);
    assert!(r.calls.is_empty());
    assert_eq!(r.content, text);
}

#[test]
fn held_back_text_is_bounded() {
    let spec = Arc::new(ToolCallSpec::new(ToolCallFormat::Hermes, None, true));
    let mut p = ToolCallParser::new(spec);
    let mut shown = 0;
    assert!(p
        .push("<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": \"")
        .is_empty());
    let chunk = "x".repeat(1000);
    let mut pushed = 0;
    while shown == 0 {
        pushed += chunk.len();
        assert!(
            pushed <= MAX_HELD + chunk.len(),
            "nothing given back after {pushed} bytes"
        );
        for d in p.push(&chunk) {
            match d {
                ChatDelta::Content(t) => shown += t.len(),
                other => panic!("{other:?}"),
            }
        }
    }
    assert!(shown > MAX_HELD - chunk.len(), "{shown}");
    // From then on the text is content as it comes.
    assert_eq!(p.push("abc"), vec![ChatDelta::Content("abc".into())]);
}

#[test]
fn without_parallel_calls_only_the_first_is_read() {
    let spec = Arc::new(ToolCallSpec::new(ToolCallFormat::Hermes, None, false));
    let mut p = ToolCallParser::new(spec);
    let text = "<tool_call>{\"name\": \"a\"}</tool_call>\n<tool_call>{\"name\": \"b\"}</tool_call>";
    let ds = p.push(text);
    assert!(p.done());
    assert_eq!(
        ds,
        vec![
            ChatDelta::ToolCallStart {
                index: 0,
                name: "a".into()
            },
            ChatDelta::ToolCallArgs {
                index: 0,
                delta: "{}".into()
            },
        ]
    );
    assert!(p.push("more").is_empty() && p.finish().is_empty());
    let ds = Arc::new(ToolCallSpec::new(ToolCallFormat::DeepSeek, None, false));
    let r = read(&ds, false, &["<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>a<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁call▁begin｜>b<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"]);
    assert_eq!(r.calls, vec![("a".to_string(), json!({}))]);
}

/// Random texts made of markup fragments, fed whole and in random pieces, read the same (and
/// never panic), for every format, with and without parallel calls.
#[test]
fn random_markup_reads_the_same_whole_and_in_pieces() {
    const PIECES: &[&str] = &[
        "<tool_call>",
        "</tool_call>",
        "<tool_",
        "</tool",
        "{\"name\": \"f\", \"arguments\": {\"a\": 1}}",
        "{\"name\": \"g\"}",
        "{\"name\"",
        "<function=f>",
        "<parameter=a>",
        "</parameter>",
        "</function>",
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁sep｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁calls▁end｜>",
        "<｜tool",
        "f",
        "function",
        "\n```json\n{}\n```",
        "{\"b\": [2]}",
        "<think>",
        "</think>",
        " ",
        "\n",
        "x",
        "é",
        "<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "<|python_tag|>",
        "<|python",
        "f.call(a=1)",
        "{\"name\": \"f\", \"parameters\": {\"a\": \")\"}}",
        "[TOOL_CALLS]",
        "[TOOL_",
        "[ARGS]",
        "[CALL_ID]",
        "[{\"name\": \"g\", \"arguments\": {}}]",
        "[",
        "]",
        "}",
        ",",
        "\"",
    ];
    // xorshift64*: deterministic and dependency-free.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: usize| {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
    };
    let specs: Vec<Arc<ToolCallSpec>> = [
        ToolCallFormat::Hermes,
        ToolCallFormat::Qwen3Coder,
        ToolCallFormat::DeepSeek,
        ToolCallFormat::Llama3,
        ToolCallFormat::Mistral,
    ]
    .into_iter()
    .flat_map(|f| [true, false].map(|p| Arc::new(ToolCallSpec::new(f, Some(&tools()), p))))
    .collect();
    let mut calls_seen = 0;
    for _ in 0..20_000 {
        let text: String = (0..1 + next(24))
            .map(|_| PIECES[next(PIECES.len())])
            .collect();
        let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).skip(1).collect();
        let mut cuts: Vec<usize> = (0..next(6))
            .filter(|_| !bounds.is_empty())
            .map(|_| bounds[next(bounds.len())])
            .collect();
        cuts.sort_unstable();
        cuts.dedup();
        let mut chunks = Vec::new();
        let mut at = 0;
        for c in cuts {
            chunks.push(&text[at..c]);
            at = c;
        }
        chunks.push(&text[at..]);
        let spec = &specs[next(specs.len())];
        let think = next(2) == 0;
        let whole = read(spec, think, &[&text]);
        assert_eq!(
            read(spec, think, &chunks),
            whole,
            "{:?} {chunks:?}",
            spec.format()
        );
        calls_seen += whole.calls.len();
    }
    // The fragments do form calls now and then.
    eprintln!("{calls_seen} calls read");
    assert!(calls_seen > 2000, "{calls_seen}");
}

/// hmoe's own `llama3` and `mistral-v7` templates (`--chat-template`): the calls they render are
/// read back. (Llama 3's drops the content of a tool-call turn.)
#[test]
fn builtin_llama3_and_mistral_calls_round_trip() {
    for (name, format, end) in [
        ("llama3", ToolCallFormat::Llama3, "<|eot_id|>"),
        (
            "mistral-v7",
            ToolCallFormat::Mistral,
            "<｜end▁of▁sentence｜>",
        ),
    ] {
        let src = hmoe_chat::builtin_template(name).unwrap();
        check_source(&src, name, format, end);
    }
}

#[test]
fn formats_are_told_from_the_template_text() {
    let llama = "{{ bos_token }}<|start_header_id|>ipython<|end_header_id|>\n\n<|python_tag|>";
    assert_eq!(ToolCallFormat::detect(llama), Some(ToolCallFormat::Llama3));
    let mistral = "[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]";
    assert_eq!(
        ToolCallFormat::detect(mistral),
        Some(ToolCallFormat::Mistral)
    );
    // A Llama 3 template without tool calls (no ipython role) reads none.
    assert_eq!(ToolCallFormat::detect("<|start_header_id|>user"), None);
}

#[test]
fn llama3_json_and_builtin_calls() {
    let spec = Arc::new(ToolCallSpec::new(
        ToolCallFormat::Llama3,
        Some(&tools()),
        true,
    ));
    // A call at the start of the answer (and one right after it).
    let text = "\n{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"days\": 3, \"opts\": {\"metric\": true}, \"note\": \"}\"}}\n {\"type\": \"function\", \"name\": \"get_time\", \"parameters\": {\"zone\": \"Europe/Paris\"}}";
    let r = read_every_way(&spec, false, text);
    let mut want = calls();
    want[0].1["note"] = json!("}");
    assert_eq!(r.calls, want);
    assert_eq!(r.content, "");
    // After reasoning; content then `<|python_tag|>` with JSON or a builtin call.
    let text = "<think>hm</think>Searching.<|python_tag|>brave_search.call(query=\"a, (b)\", n=2)";
    let r = read_every_way(&spec, false, text);
    assert_eq!(r.reasoning, "hm");
    assert_eq!(r.content, "Searching.");
    assert_eq!(
        r.calls,
        vec![("brave_search".into(), json!({"query": "a, (b)", "n": 2}))]
    );
    let text = "<|python_tag|>{\"name\": \"get_time\", \"parameters\": {}}";
    let r = read_every_way(&spec, false, text);
    assert_eq!(r.calls, vec![("get_time".into(), json!({}))]);
    // Without parallel calls only the first is read.
    let one = Arc::new(ToolCallSpec::new(ToolCallFormat::Llama3, None, false));
    let mut p = ToolCallParser::new(one);
    let d = p.push("{\"name\": \"f\", \"parameters\": {}} {\"name\": \"g\", \"parameters\": {}}");
    assert_eq!(d.len(), 2, "{d:?}");
    assert!(p.done());
}

#[test]
fn llama3_json_answers_stay_content() {
    let spec = Arc::new(ToolCallSpec::new(ToolCallFormat::Llama3, None, true));
    for text in [
        // JSON that is not a call.
        "{\"answer\": 42}",
        "{\"name\": \"Bob\", \"age\": 3}",
        "  {\"type\": \"person\", \"name\": \"f\", \"parameters\": {}}",
        // A brace later in the text: calls only open the answer.
        "Use {\"name\": \"f\", \"parameters\": {}}",
        // Malformed or cut short.
        "{\"name\": \"f\", \"parameters\": {oops}}",
        "{\"name\": \"f\", \"parameters\": {\"a\": [1",
        "<|python_tag|>f.call(x=)",
        "<|python_tag|>this is not a call, sorry",
        "<|python_ta",
    ] {
        let r = read_every_way(&spec, false, text);
        assert!(r.calls.is_empty(), "{text:?}: {r:?}");
        assert_eq!(r.content, text, "{text:?}");
    }
    // An answer that is not a call streams as it comes, not when its JSON ends.
    let mut p = ToolCallParser::new(spec);
    assert_eq!(
        p.push("{\"answer\": "),
        vec![ChatDelta::Content("{\"answer\": ".into())]
    );
}

#[test]
fn mistral_array_and_args_calls() {
    let spec = Arc::new(ToolCallSpec::new(
        ToolCallFormat::Mistral,
        Some(&tools()),
        true,
    ));
    let want = calls();
    let array = format!(
        "Let me check. [TOOL_CALLS] [{{\"name\": \"get_weather\", \"arguments\": {}, \"id\": \"abcDEF123\"}}, {{\"name\": \"get_time\", \"arguments\": \"{{\\\"zone\\\": \\\"Europe/Paris\\\"}}\", \"id\": \"x2\"}}]",
        want[0].1
    );
    let r = read_every_way(&spec, false, &array);
    assert_eq!(r.content, "Let me check.");
    assert_eq!(r.calls, want);
    let tagged = format!(
        "[TOOL_CALLS]get_weather[ARGS]{}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{{\"zone\": \"Europe/Paris\"}}",
        want[0].1
    );
    let r = read_every_way(&spec, false, &tagged);
    assert_eq!((r.content.as_str(), r.calls), ("", want.clone()));
    // Without parallel calls only the first of the array is read.
    let one = Arc::new(ToolCallSpec::new(ToolCallFormat::Mistral, None, false));
    let r = read(&one, false, &[&array]);
    assert_eq!(r.calls, want[..1].to_vec());
}

#[test]
fn malformed_mistral_calls_come_back_as_content() {
    let spec = Arc::new(ToolCallSpec::new(ToolCallFormat::Mistral, None, true));
    for text in [
        "[TOOL_CALLS] sorry, no.",
        "[TOOL_CALLS][{\"name\": \"f\", oops}]",
        "[TOOL_CALLS][]",
        "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": [1]}]",
        "[TOOL_CALLS][{\"name\": \"f\"",
        "[TOOL_CALLS]f[ARGS]{\"a\": ",
        "[TOOL_CALLS]f[ARGS]not json}",
        "[TOOL_CA",
    ] {
        let r = read_every_way(&spec, false, text);
        assert!(r.calls.is_empty(), "{text:?}: {r:?}");
        assert_eq!(r.content, text, "{text:?}");
    }
    // A good call after a bad one is still read.
    let r = read_every_way(
        &spec,
        false,
        "[TOOL_CALLS]oops![TOOL_CALLS][{\"name\": \"g\", \"arguments\": {}}]",
    );
    assert_eq!(r.content, "[TOOL_CALLS]oops!");
    assert_eq!(r.calls, vec![("g".to_string(), json!({}))]);
}

#[test]
fn self_delimited_calls_are_bounded() {
    for (format, open) in [
        (
            ToolCallFormat::Llama3,
            "{\"name\": \"f\", \"parameters\": {\"a\": \"",
        ),
        (
            ToolCallFormat::Mistral,
            "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": \"",
        ),
    ] {
        let mut p = ToolCallParser::new(Arc::new(ToolCallSpec::new(format, None, true)));
        assert!(p.push(open).is_empty(), "{format:?}");
        let chunk = "x".repeat(1000);
        let mut shown = 0;
        let mut pushed = 0;
        while shown == 0 {
            pushed += chunk.len();
            assert!(
                pushed <= MAX_HELD + chunk.len(),
                "{format:?}: held past the bound"
            );
            for d in p.push(&chunk) {
                match d {
                    ChatDelta::Content(t) => shown += t.len(),
                    other => panic!("{other:?}"),
                }
            }
        }
        assert_eq!(shown, open.len() + pushed, "{format:?}");
    }
}
