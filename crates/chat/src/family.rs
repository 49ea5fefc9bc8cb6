//! Template variables that some template families read without defining them, given as
//! llama-server gives them (its Llama 3.x and FireFunction v2 handlers):
//!
//! * Llama 3.1 / 3.2 / 3.3 (the template has `<|start_header_id|>ipython<|end_header_id|>`):
//!   `date_string`, today as `%d %b %Y` ("07 Dec 2026"; the templates otherwise print their
//!   own frozen "26 Jul 2024"), and `tools_in_user_message: false` (the tools go to the system
//!   message, not the first user message).
//! * FireFunction v2 (the template has ` functools[`): `datetime`, now as
//!   `%b %d %Y %H:%M:%S GMT`, and `functions`, the tools as JSON indented by 2 (empty without
//!   tools); the template reads its tools from `functions` only and gets no `tools`.
//!
//! Functionary v3.1 templates also have the `ipython` header but are not Llama 3.x.

use std::time::SystemTime;

use serde_json::{Map, Value};

use crate::template::{python_json, strftime, JsonStyle};

/// A template family whose variables hmoe provides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TemplateFamily {
    /// Llama 3.1 / 3.2 / 3.3: `date_string`, `tools_in_user_message`.
    Llama3,
    /// FireFunction v2: `datetime`, `functions`; no `tools`.
    FireFunctionV2,
    /// Any other template: nothing added.
    Other,
}

impl TemplateFamily {
    /// The family of a template, from its text.
    pub fn detect(source: &str) -> TemplateFamily {
        if source.contains(" functools[") {
            TemplateFamily::FireFunctionV2
        } else if source.contains("<|start_header_id|>ipython<|end_header_id|>")
            && !source.contains("<function=")
        {
            TemplateFamily::Llama3
        } else {
            TemplateFamily::Other
        }
    }

    /// Whether the template is given the request's tools as `tools`.
    pub fn takes_tools(self) -> bool {
        self != TemplateFamily::FireFunctionV2
    }

    /// The variables this family reads, at time `now`, for a request with `tools`.
    pub fn variables(self, tools: Option<&Value>, now: SystemTime) -> Map<String, Value> {
        let mut vars = Map::new();
        match self {
            TemplateFamily::Llama3 => {
                vars.insert("date_string".into(), strftime("%d %b %Y", now).into());
                vars.insert("tools_in_user_message".into(), false.into());
            }
            TemplateFamily::FireFunctionV2 => {
                vars.insert(
                    "datetime".into(),
                    strftime("%b %d %Y %H:%M:%S GMT", now).into(),
                );
                let mut functions = String::new();
                if let Some(t) = tools.filter(|t| t.as_array().is_some_and(|a| !a.is_empty())) {
                    let style = JsonStyle {
                        indent: Some(2),
                        sort_keys: false,
                        ensure_ascii: false,
                    };
                    python_json(t, &style, 0, &mut functions);
                }
                vars.insert("functions".into(), functions.into());
            }
            TemplateFamily::Other => {}
        }
        vars
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ChatTemplate;
    use serde_json::json;
    use std::time::{Duration, UNIX_EPOCH};

    // 2025-06-28 13:05:09 UTC.
    fn noon() -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_751_115_909)
    }

    #[test]
    fn detects_by_markup() {
        let llama = "<|start_header_id|>ipython<|end_header_id|>{{ date_string }}";
        assert_eq!(TemplateFamily::detect(llama), TemplateFamily::Llama3);
        let functionary = "<|start_header_id|>ipython<|end_header_id|><function=";
        assert_eq!(TemplateFamily::detect(functionary), TemplateFamily::Other);
        let fire = "{{ ns.content + ' functools[' }}";
        assert_eq!(TemplateFamily::detect(fire), TemplateFamily::FireFunctionV2);
        assert_eq!(
            TemplateFamily::detect("{{ messages }}"),
            TemplateFamily::Other
        );
    }

    #[test]
    fn llama3_gets_today_and_system_tools() {
        let src = "<|start_header_id|>ipython<|end_header_id|>\
                   {% if not date_string is defined %}{% set date_string = '26 Jul 2024' %}{% endif %}\
                   Today Date: {{ date_string }} {{ 'user' if tools_in_user_message else 'system' }}";
        let family = TemplateFamily::detect(src);
        let vars = Value::Object(family.variables(None, noon()));
        let t = ChatTemplate::new(src).unwrap();
        let out = t.render(&json!([]), None, true, &vars).unwrap();
        assert!(out.ends_with("Today Date: 28 Jun 2025 system"), "{out}");
    }

    #[test]
    fn firefunction_gets_functions_and_datetime() {
        let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
        let vars = TemplateFamily::FireFunctionV2.variables(Some(&tools), noon());
        assert_eq!(vars["datetime"], "Jun 28 2025 13:05:09 GMT");
        assert_eq!(
            vars["functions"],
            "[\n  {\n    \"type\": \"function\",\n    \"function\": {\n      \"name\": \"f\",\n      \"parameters\": {}\n    }\n  }\n]"
        );
        let none = TemplateFamily::FireFunctionV2.variables(Some(&json!([])), noon());
        assert_eq!(none["functions"], "");
        assert!(!TemplateFamily::FireFunctionV2.takes_tools());
        assert!(TemplateFamily::Other
            .variables(Some(&tools), noon())
            .is_empty());
    }
}
