//! The harmony parser, fed the o200k token stream of each rendered gpt-oss conversation one token
//! at a time, recovers the messages, channels and tool calls; and generation-side streaming.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, UNIX_EPOCH};

use hmoe_chat::{
    ChatDelta, ChatTemplate, HarmonyEvent, HarmonyMessage, HarmonyParser, HarmonyStop,
    HarmonyStream, HarmonyTokens, ReasoningFormat,
};
use hmoe_tokenizer::Tokenizer;
use serde_json::Value;

use hmoe_testdata::fixtures;

fn o200k() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let path = fixtures().join("tokenizer/ggml-vocab-o200k-harmony.gguf");
        let model = hmoe_gguf::GgufModel::open(&path, hmoe_gguf::LoadOptions::default())
            .expect("open o200k");
        Tokenizer::from_metadata(model.metadata()).expect("tokenizer")
    })
}

fn cases() -> Vec<Value> {
    let text = std::fs::read_to_string(fixtures().join("chat/gpt-oss-template-cases.json"))
        .expect("cases");
    let v: Value = serde_json::from_str(&text).expect("json");
    v["cases"].as_array().expect("cases").clone()
}

/// Feeds `ids` one at a time; checks the events agree with the collected messages.
fn parse(parser: &mut HarmonyParser, ids: &[u32]) -> Vec<HarmonyMessage> {
    let tok = o200k();
    let mut events = Vec::new();
    for &id in ids {
        events.extend(parser.push(tok, id));
    }
    events.extend(parser.finish());
    // Rebuild the messages from the events alone.
    let mut rebuilt: Vec<(String, Option<HarmonyStop>)> = Vec::new();
    for ev in events {
        match ev {
            HarmonyEvent::MessageStart(_) => rebuilt.push((String::new(), None)),
            HarmonyEvent::Content(t) => rebuilt
                .last_mut()
                .expect("content inside a message")
                .0
                .push_str(&t),
            HarmonyEvent::MessageEnd(s) => {
                rebuilt.last_mut().expect("end of a message").1 = Some(s)
            }
        }
    }
    let msgs = parser.messages().to_vec();
    assert_eq!(rebuilt.len(), msgs.len());
    for (r, m) in rebuilt.iter().zip(&msgs) {
        assert_eq!((&r.0, r.1), (&m.content, Some(m.stop)));
    }
    msgs
}

/// One message we expect to find.
struct Want<'a> {
    role: &'a str,
    name: Option<String>,
    channel: Option<&'a str>,
    recipient: Option<String>,
    content_type: Option<&'a str>,
    stop: HarmonyStop,
}

fn want(role: &str, channel: Option<&'static str>, stop: HarmonyStop) -> Want<'static> {
    let role: &'static str = match role {
        "user" => "user",
        "assistant" => "assistant",
        "tool" => "tool",
        "developer" => "developer",
        _ => "system",
    };
    Want {
        role,
        name: None,
        channel,
        recipient: None,
        content_type: None,
        stop,
    }
}

fn check(m: &HarmonyMessage, w: &Want<'_>, case: &str) {
    let h = &m.header;
    assert_eq!(h.role, w.role, "{case}: role of {m:?}");
    assert_eq!(h.name, w.name, "{case}: author of {m:?}");
    assert_eq!(h.channel.as_deref(), w.channel, "{case}: channel of {m:?}");
    assert_eq!(h.recipient, w.recipient, "{case}: recipient of {m:?}");
    assert_eq!(
        h.content_type.as_deref(),
        w.content_type,
        "{case}: content type of {m:?}"
    );
    assert_eq!(m.stop, w.stop, "{case}: stop of {m:?}");
}

#[test]
fn recovers_every_rendered_conversation() {
    let tok = o200k();
    let tokens = HarmonyTokens::from_tokenizer(tok).unwrap();
    let src = std::fs::read_to_string(fixtures().join("chat/openai-gpt-oss-120b.jinja")).unwrap();
    let frozen = UNIX_EPOCH + Duration::from_secs(1_751_112_000);
    let tmpl = ChatTemplate::with_clock(&src, Arc::new(move || frozen)).unwrap();
    let mut n_calls = 0;
    for case in cases() {
        let name = case["name"].as_str().unwrap();
        let text = case["expected_text"].as_str().unwrap();
        let ids = tok.encode(text, false, true).unwrap();
        assert_eq!(
            tok.decode(&ids),
            text.as_bytes(),
            "{name}: token round trip"
        );
        let mut parser = HarmonyParser::new(tokens);
        let msgs = parse(&mut parser, &ids);
        assert_eq!(parser.stray_text(), "", "{name}");

        let kwargs = &case["kwargs"];
        let add_gen = kwargs["add_generation_prompt"].as_bool().unwrap_or(false);
        let input = case["messages"].as_array().unwrap();
        let tools = case["tools"].as_array().filter(|t| !t.is_empty());
        let mut it = msgs.iter();

        // System message: identity, date, reasoning effort.
        let sys = it.next().unwrap();
        check(sys, &want("system", None, HarmonyStop::End), name);
        let effort = kwargs["reasoning_effort"].as_str().unwrap_or("medium");
        assert!(
            sys.content.contains(&format!("Reasoning: {effort}\n")),
            "{name}: {}",
            sys.content
        );
        assert!(sys.content.contains("Current date: 2025-06-28\n"), "{name}");
        if let Some(id) = kwargs["model_identity"].as_str() {
            assert!(sys.content.starts_with(id), "{name}");
        }

        // Developer message: instructions (first system/developer input) and function tools.
        let first_role = input[0]["role"].as_str().unwrap();
        let instructions = matches!(first_role, "system" | "developer")
            .then(|| input[0]["content"].as_str().unwrap());
        let rest: &[Value] = if instructions.is_some() {
            &input[1..]
        } else {
            input
        };
        if instructions.is_some() || tools.is_some() {
            let dev = it.next().unwrap();
            check(dev, &want("developer", None, HarmonyStop::End), name);
            if let Some(ins) = instructions {
                assert!(
                    dev.content
                        .starts_with(&format!("# Instructions\n\n{ins}\n\n")),
                    "{name}"
                );
            }
            for t in tools.into_iter().flatten() {
                let f = t["function"]["name"].as_str().unwrap();
                assert!(
                    dev.content.contains(&format!("type {f} = ")),
                    "{name}: tool {f}"
                );
            }
        }

        // The conversation.
        let mut last_call: Option<String> = None;
        for (i, m) in rest.iter().enumerate() {
            let role = m["role"].as_str().unwrap();
            let content = m["content"].as_str();
            match role {
                "user" => {
                    let got = it.next().unwrap();
                    check(got, &want("user", None, HarmonyStop::End), name);
                    assert_eq!(Some(got.content.as_str()), content, "{name}");
                }
                "assistant" if m.get("tool_calls").is_some() => {
                    let later_final = rest[i + 1..]
                        .iter()
                        .any(|f| f["role"] == "assistant" && f.get("tool_calls").is_none());
                    if !later_final {
                        let analysis = it.next().unwrap();
                        check(
                            analysis,
                            &want("assistant", Some("analysis"), HarmonyStop::End),
                            name,
                        );
                        let thought = m["thinking"].as_str().or(content).unwrap();
                        assert_eq!(analysis.content, thought, "{name}");
                    }
                    let call = &m["tool_calls"][0]["function"];
                    let fname = call["name"].as_str().unwrap();
                    let got = it.next().unwrap();
                    let mut w = want("assistant", Some("commentary"), HarmonyStop::Call);
                    w.recipient = Some(format!("functions.{fname}"));
                    w.content_type = Some("json");
                    check(got, &w, name);
                    assert_eq!(got.header.function_call(), Some(fname));
                    let args: Value =
                        serde_json::from_str(&got.content).expect("arguments are JSON");
                    assert_eq!(&args, &call["arguments"], "{name}");
                    last_call = Some(fname.to_string());
                    n_calls += 1;
                }
                "assistant" => {
                    let last_turn = i + 1 == rest.len() && !add_gen;
                    if last_turn {
                        if let Some(th) = m["thinking"].as_str() {
                            let analysis = it.next().unwrap();
                            check(
                                analysis,
                                &want("assistant", Some("analysis"), HarmonyStop::End),
                                name,
                            );
                            assert_eq!(analysis.content, th, "{name}");
                        }
                    }
                    let stop = if last_turn {
                        HarmonyStop::Return
                    } else {
                        HarmonyStop::End
                    };
                    let got = it.next().unwrap();
                    check(got, &want("assistant", Some("final"), stop), name);
                    assert_eq!(
                        Some(got.content.as_str()),
                        content,
                        "{name}: earlier analysis must be dropped"
                    );
                }
                "tool" => {
                    let got = it.next().unwrap();
                    let fname = last_call.clone().expect("tool after call");
                    let mut w = want("tool", Some("commentary"), HarmonyStop::End);
                    w.name = Some(format!("functions.{fname}"));
                    w.recipient = Some("assistant".into());
                    check(got, &w, name);
                    // The template JSON-encodes the tool output.
                    let decoded: Value =
                        serde_json::from_str(&got.content).expect("tool output is JSON");
                    assert_eq!(decoded.as_str(), content, "{name}");
                }
                other => panic!("{name}: unexpected role {other}"),
            }
        }
        assert!(it.next().is_none(), "{name}: extra messages");
        // The generation prompt leaves an open assistant header.
        assert_eq!(
            parser.pending_header(),
            add_gen.then_some("assistant"),
            "{name}"
        );

        // Re-rendering the same conversation gives the same tokens (template is deterministic).
        let again = {
            let mut kw = kwargs.as_object().cloned().unwrap();
            kw.remove("add_generation_prompt");
            kw.remove("strftime_now");
            tmpl.render(
                &case["messages"],
                case.get("tools").filter(|t| !t.is_null()),
                add_gen,
                &Value::Object(kw),
            )
            .unwrap()
        };
        assert_eq!(again, text, "{name}");
    }
    assert!(n_calls >= 1);
}

fn collect(deltas: &[ChatDelta]) -> (String, String, Vec<(String, String)>) {
    let (mut r, mut c, mut calls) = (String::new(), String::new(), Vec::<(String, String)>::new());
    for d in deltas {
        match d {
            ChatDelta::Reasoning(t) => r.push_str(t),
            ChatDelta::Content(t) => c.push_str(t),
            ChatDelta::ToolCallStart { index, name } => {
                assert_eq!(*index, calls.len());
                calls.push((name.clone(), String::new()));
            }
            ChatDelta::ToolCallArgs { index, delta } => calls[*index].1.push_str(delta),
        }
    }
    (r, c, calls)
}

fn stream(format: ReasoningFormat, output: &str) -> (Vec<ChatDelta>, Option<HarmonyStop>) {
    let tok = o200k();
    let mut s = HarmonyStream::new(HarmonyTokens::from_tokenizer(tok).unwrap(), format);
    let mut out = Vec::new();
    for id in tok.encode(output, false, true).unwrap() {
        out.extend(s.push(tok, id));
        if s.stopped().is_some() {
            break;
        }
    }
    out.extend(s.finish());
    (out, s.stopped())
}

#[test]
fn generation_reasoning_and_answer() {
    let out = "<|channel|>analysis<|message|>User asks 2+2. Easy: 4 🙂.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = **4** 🙂<|return|>";
    let (d, stop) = stream(ReasoningFormat::Auto, out);
    let (r, c, calls) = collect(&d);
    assert_eq!(r, "User asks 2+2. Easy: 4 🙂.");
    assert_eq!(c, "2 + 2 = **4** 🙂");
    assert!(calls.is_empty());
    assert_eq!(stop, Some(HarmonyStop::Return));
    // Several deltas: it streams.
    assert!(d.len() > 4);
    // `none`: the raw text, markup included.
    let (d, stop) = stream(ReasoningFormat::None, out);
    assert_eq!(collect(&d).1, out);
    assert_eq!(stop, Some(HarmonyStop::Return));
}

#[test]
fn generation_tool_call() {
    let out = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"location\": \"Tokyo\", \"unit\": \"c\"}<|call|>";
    let (d, stop) = stream(ReasoningFormat::Deepseek, out);
    let (r, c, calls) = collect(&d);
    assert_eq!(r, "Need weather.");
    assert_eq!(c, "");
    assert_eq!(
        calls,
        [(
            "get_weather".to_string(),
            "{\"location\": \"Tokyo\", \"unit\": \"c\"}".to_string()
        )]
    );
    assert_eq!(stop, Some(HarmonyStop::Call));
}

#[test]
fn harmony_library_streaming_sample() {
    // openai-harmony's own streaming test: analysis, a browser tool call, the tool's answer.
    let text = std::fs::read_to_string(
        fixtures().join("chat/harmony-test-data/test_streamable_parser.txt"),
    )
    .unwrap();
    let tok = o200k();
    let mut p = HarmonyParser::for_generation(HarmonyTokens::from_tokenizer(tok).unwrap());
    let msgs = parse(&mut p, &tok.encode(&text, false, true).unwrap());
    assert_eq!(msgs.len(), 3);
    assert_eq!(msgs[0].header.channel.as_deref(), Some("analysis"));
    assert!(msgs[0]
        .content
        .starts_with("User asks \"Who is the current US president?\""));
    assert_eq!(msgs[1].header.recipient.as_deref(), Some("browser.search"));
    assert_eq!(msgs[1].header.content_type.as_deref(), Some("code"));
    assert_eq!(msgs[1].stop, HarmonyStop::Call);
    assert_eq!(msgs[2].header.name.as_deref(), Some("browser.search"));
    assert_eq!(msgs[2].content, "{\"result\": \"https://openai.com/\"}");
    // Built-in tool calls are not surfaced as function calls.
    let (d, _) = stream(ReasoningFormat::Auto, &text);
    assert!(collect(&d).2.is_empty());
}

#[test]
fn gpt_oss_model_file_template_and_specials() {
    // The synthetic gpt-oss GGUF carries the gpt-oss template and the harmony specials.
    let path = fixtures().join("gpt-oss/gptoss-tiny.gguf");
    let model = hmoe_gguf::GgufModel::open(&path, hmoe_gguf::LoadOptions::default()).unwrap();
    let src = hmoe_chat::load_chat_template(model.metadata(), None).unwrap();
    let tok = Tokenizer::from_metadata(model.metadata()).unwrap();
    let vars = hmoe_chat::special_token_vars(&tok);
    assert_eq!(vars["bos_token"], "<|startoftext|>");
    assert_eq!(vars["eos_token"], "<|return|>");
    let text = ChatTemplate::new(&src)
        .unwrap()
        .render(
            &serde_json::json!([{"role": "user", "content": "hi"}]),
            None,
            true,
            &vars,
        )
        .unwrap();
    assert!(
        text.ends_with("<|start|>user<|message|>hi<|end|><|start|>assistant"),
        "{text}"
    );
    let t = HarmonyTokens::from_tokenizer(&tok).unwrap();
    assert_eq!((t.start, t.return_, t.call), (1020, 1017, 1023));
    assert!(tok.is_eog(t.return_) && tok.is_eog(t.call) && !tok.is_eog(t.end));
    let ids = tok.encode(&text, false, true).unwrap();
    let mut p = HarmonyParser::new(t);
    for &id in &ids {
        p.push(&tok, id);
    }
    assert_eq!(p.messages().len(), 2);
    assert_eq!(p.messages()[1].content, "hi");
    assert_eq!(p.pending_header(), Some("assistant"));
}

#[test]
fn output_that_is_not_harmony_streams_as_content() {
    // A model with random weights does not write a harmony header: its text is the content, as
    // it comes (not at the end), without control tokens.
    let (d, _) = stream(
        ReasoningFormat::Auto,
        "Just some plain words here<|return|>",
    );
    let (r, c, calls) = collect(&d);
    assert_eq!((r.as_str(), c.as_str()), ("", "Just some plain words here"));
    assert!(calls.is_empty());
    assert!(d.len() >= 4, "{d:?}");
    // Output that starts as harmony is read as harmony.
    let (d, _) = stream(ReasoningFormat::Auto, "<|channel|>analysis<|message|>x");
    assert_eq!(collect(&d).0, "x");
}
