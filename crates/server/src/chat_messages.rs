//! The messages and tools of a chat request checked and rewritten the way Hugging Face
//! templates expect them.

use serde_json::Value;

use crate::error::ApiError;

/// Checks a request's `tools` and fills what templates read without checking: every function
/// gets a `description` (empty) and `parameters` (an empty object schema) when it has none, as
/// llama-server does. `None` when there are no tools or `tool_choice` is `"none"`.
pub fn normalize_tools(
    tools: Option<&Value>,
    tool_choice: Option<&Value>,
) -> Result<Option<Value>, ApiError> {
    let list = match tools {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(t)) => t,
        Some(_) => return Err(ApiError::bad_request("'tools' must be an array")),
    };
    if list.is_empty() || tool_choice.and_then(Value::as_str) == Some("none") {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let mut t = t.clone();
        let f = t
            .get_mut("function")
            .and_then(Value::as_object_mut)
            .filter(|f| f.get("name").is_some_and(Value::is_string))
            .ok_or_else(|| {
                ApiError::bad_request(format!(
                    "tools[{i}]: every tool needs a 'function' with a 'name'"
                ))
            })?;
        if !f.get("description").is_some_and(Value::is_string) {
            f.insert("description".into(), "".into());
        }
        if !f.get("parameters").is_some_and(Value::is_object) {
            f.insert(
                "parameters".into(),
                serde_json::json!({"type": "object", "properties": {}}),
            );
        }
        out.push(t);
    }
    Ok(Some(Value::Array(out)))
}

/// Text of an OpenAI `content` value: a string, or the text parts of an array one per line, as
/// llama-server gives them to a template.
pub fn content_text(v: &Value, what: &str) -> Result<String, ApiError> {
    joined_content(v, what, "\n")
}

/// Text of a `content` value, its parts joined by `sep`.
pub fn joined_content(v: &Value, what: &str, sep: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => {
            let mut out = String::new();
            for (i, p) in parts.iter().enumerate() {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text") | None, Some(t)) => {
                        if i > 0 {
                            out.push_str(sep);
                        }
                        out.push_str(t)
                    }
                    (Some(ty), _) => {
                        return Err(ApiError::bad_request(format!(
                            "{what}: content parts of type '{ty}' are not supported"
                        )))
                    }
                    _ => {
                        return Err(ApiError::bad_request(format!(
                            "{what}: a content part has no text"
                        )))
                    }
                }
            }
            Ok(out)
        }
        _ => Err(ApiError::bad_request(format!(
            "{what}: 'content' must be a string or an array of parts"
        ))),
    }
}

/// Checks OpenAI messages and rewrites them the way templates expect: `content` as a string,
/// reasoning as both `reasoning_content` (Qwen3, DeepSeek templates) and `thinking` (gpt-oss),
/// tool-call `arguments` as JSON objects, no `content` on assistant tool-call messages that have
/// none.
pub fn normalize_messages(messages: Option<&Value>) -> Result<Value, ApiError> {
    let Some(Value::Array(list)) = messages else {
        return Err(ApiError::bad_request(
            "'messages' must be an array of messages",
        ));
    };
    if list.is_empty() {
        return Err(ApiError::bad_request("'messages' must not be empty"));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let what = format!("messages[{i}]");
        let Value::Object(m) = m else {
            return Err(ApiError::bad_request(format!("{what} must be an object")));
        };
        let Some(role) = m.get("role").and_then(Value::as_str) else {
            return Err(ApiError::bad_request(format!(
                "{what} has no string 'role'"
            )));
        };
        let mut n = m.clone();
        let has_calls = match m.get("tool_calls") {
            None | Some(Value::Null) => {
                n.remove("tool_calls");
                false
            }
            Some(Value::Array(calls)) => {
                let mut fixed = Vec::with_capacity(calls.len());
                for (j, c) in calls.iter().enumerate() {
                    fixed.push(normalize_tool_call(c, &format!("{what}.tool_calls[{j}]"))?);
                }
                let any = !fixed.is_empty();
                n.insert("tool_calls".into(), Value::Array(fixed));
                if !any {
                    n.remove("tool_calls");
                }
                any
            }
            Some(_) => {
                return Err(ApiError::bad_request(format!(
                    "{what}: 'tool_calls' must be an array"
                )))
            }
        };
        let text = content_text(m.get("content").unwrap_or(&Value::Null), &what)?;
        if role == "assistant" && has_calls && text.is_empty() {
            n.remove("content");
        } else {
            n.insert("content".into(), text.into());
        }
        let reasoning = match (m.get("reasoning_content"), m.get("thinking")) {
            (Some(r), _) if !r.is_null() => content_text(r, &what)?,
            (_, Some(r)) if !r.is_null() => content_text(r, &what)?,
            _ => String::new(),
        };
        n.remove("reasoning_content");
        n.remove("thinking");
        if !reasoning.is_empty() {
            n.insert("reasoning_content".into(), reasoning.clone().into());
            n.insert("thinking".into(), reasoning.into());
        }
        out.push(Value::Object(n));
    }
    Ok(Value::Array(out))
}

fn normalize_tool_call(c: &Value, what: &str) -> Result<Value, ApiError> {
    let Value::Object(c) = c else {
        return Err(ApiError::bad_request(format!("{what} must be an object")));
    };
    let mut c = c.clone();
    let Some(Value::Object(f)) = c.get_mut("function") else {
        return Err(ApiError::bad_request(format!(
            "{what} has no 'function' object"
        )));
    };
    if f.get("name").and_then(Value::as_str).is_none() {
        return Err(ApiError::bad_request(format!(
            "{what}.function has no string 'name'"
        )));
    }
    if let Some(Value::String(args)) = f.get("arguments") {
        if let Ok(parsed) = serde_json::from_str::<Value>(args) {
            f.insert("arguments".into(), parsed);
        }
    }
    Ok(Value::Object(c))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn messages_are_normalised() {
        let m = json!([
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "reasoning_content": "think",
             "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
            {"role": "tool", "tool_call_id": "x", "content": "42"},
            {"role": "assistant", "content": null}
        ]);
        let n = normalize_messages(Some(&m)).unwrap();
        assert_eq!(n[0]["content"], "a\nb");
        assert!(n[1].get("content").is_none());
        assert_eq!(n[1]["thinking"], "think");
        assert_eq!(n[1]["reasoning_content"], "think");
        assert_eq!(
            n[1]["tool_calls"][0]["function"]["arguments"],
            json!({"a": 1})
        );
        assert_eq!(n[3]["content"], "");
    }

    #[test]
    fn bad_messages_are_400() {
        for bad in [
            json!(null),
            json!([]),
            json!([1]),
            json!([{"content": "x"}]),
            json!([{"role": "user", "content": 5}]),
            json!([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
            json!([{"role": "assistant", "tool_calls": [{"function": {}}]}]),
        ] {
            let e = normalize_messages(Some(&bad)).unwrap_err();
            assert_eq!(e.status.as_u16(), 400, "{bad}");
        }
        assert!(normalize_messages(None).is_err());
    }
}
