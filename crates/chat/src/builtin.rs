//! Chat templates built in by name, for `--chat-template NAME` (llama.cpp accepts the same names
//! for models whose GGUF lacks a template or carries a broken one).
//!
//! Each is a Jinja template written for hmoe that produces the prompt format its name stands for;
//! messages arrive normalised (string `content`, or none on assistant tool-call turns; reasoning
//! as `reasoning_content` / `thinking`; tool-call `arguments` as objects).

/// ChatML (`<|im_start|>role\n…<|im_end|>`), with Hermes-style `<tools>` / `<tool_call>` blocks.
const CHATML: &str = r#"{%- set ns = namespace(system='', last_user=-1) -%}
{%- set think = _qwen3_think is defined and _qwen3_think -%}
{%- if messages and messages[0].role == 'system' -%}{%- set ns.system = messages[0].content or '' -%}{%- endif -%}
{%- if tools -%}
{%- set ns.system = ns.system + ('\n\n' if ns.system else '') + '# Tools\n\nFunctions you may call are listed as JSON schemas inside <tools></tools>:\n<tools>' -%}
{%- for t in tools -%}{%- set ns.system = ns.system + '\n' + (t | tojson) -%}{%- endfor -%}
{%- set ns.system = ns.system + '\n</tools>\n\nTo call a function, answer with a JSON object holding its name and arguments inside <tool_call></tool_call>:\n<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>' -%}
{%- endif -%}
{%- if ns.system -%}{{- '<|im_start|>system\n' + ns.system + '<|im_end|>\n' -}}{%- endif -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'system' and loop.first -%}
{%- elif m.role == 'tool' -%}
{{- '<|im_start|>user\n<tool_response>\n' + (m.content or '') + '\n</tool_response><|im_end|>\n' -}}
{%- elif m.role == 'assistant' -%}
{{- '<|im_start|>assistant\n' -}}
{%- set reasoning = m.reasoning_content or m.thinking or '' -%}
{%- if think and reasoning and loop.index0 > ns.last_user -%}{{- '<think>\n' + reasoning + '\n</think>\n\n' -}}{%- endif -%}
{{- m.content or '' -}}
{%- for tc in m.tool_calls or [] -%}
{{- ('\n' if (m.content or loop.index0 > 0) else '') + '<tool_call>\n' + ({'name': tc.function.name, 'arguments': tc.function.arguments} | tojson) + '\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' + m.role + '\n' + (m.content or '') + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if think and enable_thinking is defined and not enable_thinking -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}"#;

/// Llama 3.x headers; tool results as `ipython`, tool calls as `{"name", "parameters"}` JSON.
const LLAMA3: &str = r#"{{- bos_token or '' -}}
{%- set ns = namespace(system='') -%}
{%- if messages and messages[0].role == 'system' -%}{%- set ns.system = messages[0].content or '' -%}{%- endif -%}
{%- if tools -%}
{%- set ns.system = ns.system + ('\n\n' if ns.system else '') + 'You may call these functions; to call one, answer with only a JSON object {"name": function name, "parameters": arguments object}.' -%}
{%- for t in tools -%}{%- set ns.system = ns.system + '\n\n' + (t | tojson(indent=4)) -%}{%- endfor -%}
{%- endif -%}
{%- if ns.system -%}{{- '<|start_header_id|>system<|end_header_id|>\n\n' + ns.system | trim + '<|eot_id|>' -}}{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' and loop.first -%}
{%- elif m.role == 'tool' -%}
{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + (m.content or '') | trim + '<|eot_id|>' -}}
{%- elif m.role == 'assistant' and m.tool_calls -%}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- for tc in m.tool_calls -%}{{- ('\n' if loop.index0 > 0 else '') + ({'name': tc.function.name, 'parameters': tc.function.arguments} | tojson) -}}{%- endfor -%}
{{- '<|eot_id|>' -}}
{%- else -%}
{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + (m.content or '') | trim + '<|eot_id|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}"#;

/// gpt-oss harmony: system message (date, reasoning effort), developer message with the
/// instructions and the functions as a TypeScript namespace, analysis for tool-call turns.
const GPT_OSS: &str = r#"{%- macro ts_type(s) -%}
{%- if s.enum -%}{%- for v in s.enum -%}{{- (' | ' if loop.index0 > 0 else '') + (v | tojson) -}}{%- endfor -%}
{%- elif s.type == 'string' -%}string
{%- elif s.type == 'number' or s.type == 'integer' -%}number
{%- elif s.type == 'boolean' -%}boolean
{%- elif s.type == 'array' -%}{{- (ts_type(s['items']) if s['items'] else 'any') + '[]' -}}
{%- elif s.type == 'object' and s.properties -%}{{- '{\n' -}}
{%- for k, v in s.properties.items() -%}{{- k + ('' if k in (s.required or []) else '?') + ': ' + ts_type(v) + ',\n' -}}{%- endfor -%}
{{- '}' -}}
{%- elif s.type == 'object' -%}object
{%- else -%}any
{%- endif -%}
{%- endmacro -%}
{{- '<|start|>system<|message|>' + (model_identity or 'You are ChatGPT, a large language model trained by OpenAI.') + '\nKnowledge cutoff: 2024-06\nCurrent date: ' + strftime_now('%Y-%m-%d') + '\n\nReasoning: ' + (reasoning_effort or 'medium') + '\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.' -}}
{%- if tools -%}{{- "\nCalls to these tools must go to the commentary channel: 'functions'." -}}{%- endif -%}
{{- '<|end|>' -}}
{%- set ns = namespace(dev='', start=0, call='') -%}
{%- if messages and messages[0].role in ['system', 'developer'] -%}{%- set ns.dev = messages[0].content or '' -%}{%- set ns.start = 1 -%}{%- endif -%}
{%- if ns.dev or tools -%}
{{- '<|start|>developer<|message|>' -}}
{%- if ns.dev -%}{{- '# Instructions\n\n' + ns.dev + '\n\n' -}}{%- endif -%}
{%- if tools -%}
{{- '# Tools\n\n## functions\n\nnamespace functions {\n\n' -}}
{%- for t in tools -%}{%- set f = t.function or t -%}
{%- if f.description -%}{{- '// ' + f.description + '\n' -}}{%- endif -%}
{%- if f.parameters and f.parameters.properties -%}{{- 'type ' + f.name + ' = (_: ' + ts_type(f.parameters) + ') => any;\n\n' -}}
{%- else -%}{{- 'type ' + f.name + ' = () => any;\n\n' -}}{%- endif -%}
{%- endfor -%}
{{- '} // namespace functions' -}}
{%- endif -%}
{{- '<|end|>' -}}
{%- endif -%}
{%- for m in messages[ns.start:] -%}
{%- if m.role == 'assistant' and m.tool_calls -%}
{%- set reasoning = m.thinking or m.reasoning_content or m.content or '' -%}
{%- if reasoning -%}{{- '<|start|>assistant<|channel|>analysis<|message|>' + reasoning + '<|end|>' -}}{%- endif -%}
{%- for tc in m.tool_calls -%}
{{- '<|start|>assistant to=functions.' + tc.function.name + '<|channel|>commentary json<|message|>' + (tc.function.arguments if tc.function.arguments is string else (tc.function.arguments | tojson)) + '<|call|>' -}}
{%- set ns.call = tc.function.name -%}
{%- endfor -%}
{%- elif m.role == 'assistant' -%}
{{- '<|start|>assistant<|channel|>final<|message|>' + (m.content or '') + '<|end|>' -}}
{%- elif m.role == 'tool' -%}
{{- '<|start|>functions.' + (m.name or ns.call or 'unknown') + ' to=assistant<|channel|>commentary<|message|>' + (m.content or '') + '<|end|>' -}}
{%- elif m.role in ['system', 'developer'] -%}
{{- '<|start|>developer<|message|>' + (m.content or '') + '<|end|>' -}}
{%- else -%}
{{- '<|start|>' + m.role + '<|message|>' + (m.content or '') + '<|end|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"#;

/// DeepSeek V3 (`<｜User｜>` / `<｜Assistant｜>`, DeepSeek's tool-call markers).
const DEEPSEEK3: &str = r#"{{- bos_token or '' -}}
{%- for m in messages -%}{%- if m.role == 'system' -%}{{- m.content or '' -}}{%- endif -%}{%- endfor -%}
{%- set ns = namespace(in_tools=false) -%}
{%- for m in messages -%}
{%- if m.role != 'tool' and ns.in_tools -%}{{- '<｜tool▁outputs▁end｜>' -}}{%- set ns.in_tools = false -%}{%- endif -%}
{%- if m.role == 'user' -%}{{- '<｜User｜>' + (m.content or '') -}}
{%- elif m.role == 'assistant' -%}
{{- '<｜Assistant｜>' + (m.content or '') -}}
{%- if m.tool_calls -%}
{{- '<｜tool▁calls▁begin｜>' -}}
{%- for tc in m.tool_calls -%}{{- '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + tc.function.name + '\n```json\n' + (tc.function.arguments | tojson) + '\n```<｜tool▁call▁end｜>' -}}{%- endfor -%}
{{- '<｜tool▁calls▁end｜>' -}}
{%- endif -%}
{{- '<｜end▁of▁sentence｜>' -}}
{%- elif m.role == 'tool' -%}
{%- if not ns.in_tools -%}{{- '<｜tool▁outputs▁begin｜>' -}}{%- set ns.in_tools = true -%}{%- endif -%}
{{- '<｜tool▁output▁begin｜>' + (m.content or '') + '<｜tool▁output▁end｜>' -}}
{%- endif -%}
{%- endfor -%}
{%- if ns.in_tools -%}{{- '<｜tool▁outputs▁end｜>' -}}{%- endif -%}
{%- if add_generation_prompt -%}{{- '<｜Assistant｜>' -}}{%- endif -%}"#;

/// DeepSeek 2 (`User: ` / `Assistant: `).
const DEEPSEEK2: &str = r#"{{- bos_token or '' -}}
{%- for m in messages -%}
{%- if m.role == 'system' -%}{{- (m.content or '') + '\n\n' -}}
{%- elif m.role == 'assistant' -%}{{- 'Assistant: ' + (m.content or '') + (eos_token or '') -}}
{%- else -%}{{- 'User: ' + (m.content or '') + '\n\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- 'Assistant:' -}}{%- endif -%}"#;

/// Phi-3 (`<|role|>\n…<|end|>\n`).
const PHI3: &str = r#"{%- for m in messages -%}
{{- '<|' + ('user' if m.role == 'tool' else m.role) + '|>\n' + (m.content or '') + '<|end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}"#;

/// Zephyr (`<|role|>\n…</s>\n`).
const ZEPHYR: &str = r#"{%- for m in messages -%}
{{- '<|' + ('user' if m.role == 'tool' else m.role) + '|>\n' + (m.content or '') + (eos_token or '</s>') + '\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}"#;

/// Gemma (`<start_of_turn>user` / `model`; the system text opens the first user turn).
const GEMMA: &str = r#"{{- bos_token or '' -}}
{%- set ns = namespace(system='') -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}{%- set ns.system = ns.system + (m.content or '') + '\n\n' -%}
{%- else -%}
{{- '<start_of_turn>' + ('model' if m.role == 'assistant' else 'user') + '\n' + (ns.system if m.role != 'assistant' else '') + (m.content or '') | trim + '<end_of_turn>\n' -}}
{%- if m.role != 'assistant' -%}{%- set ns.system = '' -%}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"#;

/// Mistral v7 (`[SYSTEM_PROMPT]`, `[INST]`, `[TOOL_CALLS]`, `[TOOL_RESULTS]`).
const MISTRAL_V7: &str = r#"{{- bos_token or '' -}}
{%- for m in messages -%}
{%- if m.role == 'system' -%}{{- '[SYSTEM_PROMPT] ' + (m.content or '') + '[/SYSTEM_PROMPT]' -}}
{%- elif m.role == 'user' -%}{{- '[INST] ' + (m.content or '') + '[/INST]' -}}
{%- elif m.role == 'tool' -%}{{- '[TOOL_RESULTS] ' + (m.content or '') + '[/TOOL_RESULTS]' -}}
{%- elif m.role == 'assistant' -%}
{{- ' ' + (m.content or '') -}}
{%- if m.tool_calls -%}{{- '[TOOL_CALLS] ' + (m.tool_calls | map(attribute='function') | list | tojson) -}}{%- endif -%}
{{- eos_token or '</s>' -}}
{%- endif -%}
{%- endfor -%}"#;

/// Command-R (`<|START_OF_TURN_TOKEN|><|USER_TOKEN|>…<|END_OF_TURN_TOKEN|>`, contents
/// trimmed, as llama.cpp's built-in `command-r` writes them); tool results as system turns,
/// tool calls as Cohere's `Action:` JSON list.
const COMMAND_R: &str = r#"{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' + (m.content or '') | trim -}}
{%- if m.tool_calls -%}
{%- set ns = namespace(calls=[]) -%}
{%- for tc in m.tool_calls -%}{%- set ns.calls = ns.calls + [{'tool_name': tc.function.name, 'parameters': tc.function.arguments}] -%}{%- endfor -%}
{{- ('\n' if m.content else '') + 'Action: ```json\n' + (ns.calls | tojson) + '\n```' -}}
{%- endif -%}
{{- '<|END_OF_TURN_TOKEN|>' -}}
{%- elif m.role == 'user' -%}
{{- '<|START_OF_TURN_TOKEN|><|USER_TOKEN|>' + (m.content or '') | trim + '<|END_OF_TURN_TOKEN|>' -}}
{%- else -%}
{{- '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>' + (m.content or '') | trim + '<|END_OF_TURN_TOKEN|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' -}}{%- endif -%}"#;

/// The names `--chat-template` accepts, with their templates.
const BUILTIN: &[(&str, &str)] = &[
    ("chatml", CHATML),
    ("qwen3", CHATML),
    ("llama3", LLAMA3),
    ("gpt-oss", GPT_OSS),
    ("deepseek3", DEEPSEEK3),
    ("deepseek2", DEEPSEEK2),
    ("phi3", PHI3),
    ("zephyr", ZEPHYR),
    ("gemma", GEMMA),
    ("mistral-v7", MISTRAL_V7),
    ("command-r", COMMAND_R),
];

/// The names of the built-in templates.
pub fn builtin_template_names() -> impl Iterator<Item = &'static str> {
    BUILTIN.iter().map(|(n, _)| *n)
}

/// The template source of a built-in name (`chatml`, `llama3`, `gpt-oss`, …), or `None`.
///
/// In ChatML the `<think>` handling (reasoning of the current turn rendered, `enable_thinking:
/// false` closing an empty think block) is on for `qwen3` only.
pub fn builtin_template(name: &str) -> Option<String> {
    let (_, src) = BUILTIN.iter().find(|(n, _)| *n == name)?;
    Some(if name == "qwen3" {
        format!("{{%- set _qwen3_think = true -%}}{src}")
    } else {
        src.to_string()
    })
}

/// `--chat-template VALUE`: a built-in name, else the value itself as Jinja text.
pub fn resolve_chat_template(value: &str) -> String {
    builtin_template(value.trim()).unwrap_or_else(|| value.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ChatTemplate;
    use serde_json::json;

    fn render(name: &str, messages: serde_json::Value, tools: Option<serde_json::Value>) -> String {
        let t = ChatTemplate::new(&builtin_template(name).unwrap()).unwrap();
        t.render(
            &messages,
            tools.as_ref(),
            true,
            &json!({"bos_token": "<s>", "eos_token": "</s>"}),
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    #[test]
    fn chatml_and_llama3_render_exactly() {
        let m =
            json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]);
        assert_eq!(
            render("chatml", m.clone(), None),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            render("llama3", m, None),
            "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        );
    }

    #[test]
    fn every_builtin_renders_tool_turns() {
        let tools = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "array", "items": {"type": "integer"}}}, "required": ["city"]}}}]);
        let m = json!([
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "reasoning_content": "need a tool", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"},
            {"role": "assistant", "content": "Sunny."},
            {"role": "user", "content": "Thanks"}
        ]);
        for name in builtin_template_names() {
            let out = render(name, m.clone(), Some(tools.clone()));
            assert!(
                out.contains("Weather in Paris?") && out.contains("Thanks"),
                "{name}: {out}"
            );
            assert!(out.contains("{\"temp\": 21}"), "{name}: {out}");
            assert!(out.contains("Sunny."), "{name}: {out}");
        }
        let oss = render("gpt-oss", m.clone(), Some(tools));
        assert!(
            oss.contains("type get_weather = (_: {\ncity: string,\ndays?: number[],\n}) => any;"),
            "{oss}"
        );
        assert!(oss.contains("<|start|>assistant<|channel|>analysis<|message|>need a tool<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\"}<|call|>"), "{oss}");
        assert!(oss.contains("<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{\"temp\": 21}<|end|>"), "{oss}");
        assert!(
            oss.ends_with("<|start|>user<|message|>Thanks<|end|><|start|>assistant"),
            "{oss}"
        );
        let qwen = render("qwen3", m, None);
        assert!(
            !qwen.contains("need a tool"),
            "reasoning before the last user turn is dropped: {qwen}"
        );
    }

    #[test]
    fn command_r_renders_as_llama_cpp_builtin() {
        let m = json!([{"role": "system", "content": "You are a test."},
                       {"role": "user", "content": " Hi there"}]);
        assert_eq!(
            render("command-r", m, None),
            "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
        );
    }

    #[test]
    fn names_resolve_or_pass_through() {
        assert!(resolve_chat_template("gpt-oss").contains("<|channel|>"));
        assert!(resolve_chat_template("qwen3").contains("<think>"));
        assert_eq!(resolve_chat_template("{{ messages }}"), "{{ messages }}");
        assert!(builtin_template("no-such").is_none());
    }
}
