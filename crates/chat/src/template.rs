//! Hugging Face chat templates rendered with minijinja, configured like transformers'
//! `render_jinja_template`: `trim_blocks` and `lstrip_blocks` on, loop controls, Python string and
//! dict methods (`pycompat`), `raise_exception`, `strftime_now` and a `tojson` that prints what
//! Python's `json.dumps(x, ensure_ascii=False)` prints (`", "` / `": "` separators, key order kept).

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, Serde};
use minijinja::{Environment, Error, ErrorKind, UndefinedBehavior, Value};

use crate::ChatError;

/// Where `strftime_now` gets the time (tests freeze it). Times are formatted in UTC.
pub type Clock = Arc<dyn Fn() -> SystemTime + Send + Sync>;

/// Marks errors raised by the template's own `raise_exception`.
const RAISED: &str = "\u{1}raise_exception:";

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source` with `strftime_now` reading the system clock.
    pub fn new(source: &str) -> Result<ChatTemplate, ChatError> {
        ChatTemplate::with_clock(source, Arc::new(SystemTime::now))
    }

    /// Compiles `source` with `strftime_now` reading `clock`.
    pub fn with_clock(source: &str, clock: Clock) -> Result<ChatTemplate, ChatError> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| ChatError::Template(e.to_string()))?,
        );
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson_filter);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("{RAISED}{msg}"),
            ))
        });
        env.add_function("strftime_now", move |format: String| -> String {
            strftime(&format, clock())
        });
        env.add_template_owned("chat_template", source.to_string())
            .map_err(|e| ChatError::Template(describe(&e)))?;
        Ok(ChatTemplate { env })
    }

    /// Renders the conversation.
    ///
    /// `messages` is the OpenAI-style message list, `tools` the tool list (passed as `tools`,
    /// `none` when absent), `extra` an object of further template variables (`reasoning_effort`,
    /// `builtin_tools`, `model_identity`, `bos_token`, `enable_thinking`, ...).
    pub fn render(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        extra: &serde_json::Value,
    ) -> Result<String, ChatError> {
        let mut ctx = serde_json::Map::new();
        match extra {
            serde_json::Value::Null => {}
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    ctx.insert(k.clone(), v.clone());
                }
            }
            other => {
                return Err(ChatError::Input(format!(
                    "template variables must be an object, got {other}"
                )))
            }
        }
        ctx.insert("messages".into(), messages.clone());
        ctx.insert(
            "tools".into(),
            tools.cloned().unwrap_or(serde_json::Value::Null),
        );
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        let tmpl = self
            .env
            .get_template("chat_template")
            .map_err(|e| ChatError::Template(describe(&e)))?;
        tmpl.render(Value::from(Serde(&serde_json::Value::Object(ctx))))
            .map_err(|e| match raised(&e) {
                Some(msg) => ChatError::Raised(msg),
                None => ChatError::Template(describe(&e)),
            })
    }
}

/// Compiles and renders a chat template in one go (system clock for `strftime_now`); see
/// [`ChatTemplate::render`].
pub fn render_template(
    template: &str,
    messages: &serde_json::Value,
    tools: Option<&serde_json::Value>,
    add_generation_prompt: bool,
    extra: &serde_json::Value,
) -> Result<String, ChatError> {
    ChatTemplate::new(template)?.render(messages, tools, add_generation_prompt, extra)
}

/// The message of a `raise_exception` anywhere in the error chain.
fn raised(e: &Error) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(me) = err.downcast_ref::<Error>() {
            if let Some(msg) = me.detail().and_then(|d| d.strip_prefix(RAISED)) {
                return Some(msg.to_string());
            }
        }
        cur = err.source();
    }
    None
}

/// An error with its causes and location.
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut cur = std::error::Error::source(e);
    while let Some(err) = cur {
        let _ = write!(s, ": {err}");
        cur = err.source();
    }
    s
}

/// `tojson(indent=None, sort_keys=False, ensure_ascii=False)` as transformers defines it.
fn tojson_filter(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let opts = JsonStyle {
        indent,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    python_json(&json, &opts, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// `json.dumps` options.
pub(crate) struct JsonStyle {
    pub indent: Option<usize>,
    pub sort_keys: bool,
    pub ensure_ascii: bool,
}

/// Writes `v` exactly as Python's `json.dumps` would with these options.
pub(crate) fn python_json(v: &serde_json::Value, o: &JsonStyle, level: usize, out: &mut String) {
    use serde_json::Value as J;
    let (item_sep, newline) = match o.indent {
        Some(_) => (",", true),
        None => (", ", false),
    };
    let pad = |out: &mut String, level: usize| {
        if let Some(n) = o.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * level));
        }
    };
    match v {
        J::Null => out.push_str("null"),
        J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        J::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => {
                let _ = write!(out, "{i}");
            }
            (_, Some(u), _) => {
                let _ = write!(out, "{u}");
            }
            (_, _, Some(f)) => out.push_str(&python_float(f)),
            _ => out.push_str("null"),
        },
        J::String(s) => python_string(s, o.ensure_ascii, out),
        J::Array(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                if newline {
                    pad(out, level + 1);
                }
                python_json(item, o, level + 1, out);
            }
            if newline {
                pad(out, level);
            }
            out.push(']');
        }
        J::Object(map) => {
            if map.is_empty() {
                out.push_str("{}");
                return;
            }
            let mut entries: Vec<(&String, &J)> = map.iter().collect();
            if o.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, val)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                if newline {
                    pad(out, level + 1);
                }
                python_string(k, o.ensure_ascii, out);
                out.push_str(": ");
                python_json(val, o, level + 1, out);
            }
            if newline {
                pad(out, level);
            }
            out.push('}');
        }
    }
}

/// A JSON string literal as Python writes it.
fn python_string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: shortest round-trip digits, exponent form below 1e-4 and from 1e16.
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    if f == 0.0 {
        return if f.is_sign_negative() {
            "-0.0".into()
        } else {
            "0.0".into()
        };
    }
    // `{:e}` gives the shortest round-trip mantissa, e.g. "1.5e-7".
    let e = format!("{f:e}");
    let (mant, exp) = e.split_once('e').unwrap_or((&e, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mant) = mant.strip_prefix('-').map_or(("", mant), |m| ("-", m));
    let digits: String = mant.chars().filter(|c| c.is_ascii_digit()).collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let s = if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if point as usize >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            format!(
                "{}.{}",
                &digits[..point as usize],
                &digits[point as usize..]
            )
        };
        format!("{sign}{s}")
    } else {
        let m = if digits.len() > 1 {
            format!("{}.{}", &digits[..1], &digits[1..])
        } else {
            digits
        };
        format!(
            "{sign}{m}e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.abs()
        )
    }
}

/// `strftime` in UTC for the directives chat templates use; unknown directives are kept.
pub(crate) fn strftime(format: &str, t: SystemTime) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
    ];
    let secs = match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_secs() as i64,
        Err(e) => -(e.duration().as_secs() as i64),
    };
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (sod / 3600, sod % 3600 / 60, sod % 60);
    let weekday = (days + 4).rem_euclid(7) as usize;
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(d) = chars.next() else {
            out.push('%');
            break;
        };
        let month_name = MONTHS[(month - 1) as usize];
        let _ = match d {
            'Y' => write!(out, "{year}"),
            'y' => write!(out, "{:02}", year.rem_euclid(100)),
            'm' => write!(out, "{month:02}"),
            'd' => write!(out, "{day:02}"),
            'e' => write!(out, "{day:2}"),
            'H' => write!(out, "{hour:02}"),
            'I' => write!(out, "{:02}", if hour % 12 == 0 { 12 } else { hour % 12 }),
            'p' => write!(out, "{}", if hour < 12 { "AM" } else { "PM" }),
            'M' => write!(out, "{minute:02}"),
            'S' => write!(out, "{second:02}"),
            'j' => write!(out, "{yday:03}"),
            'B' => write!(out, "{month_name}"),
            'b' | 'h' => write!(out, "{}", &month_name[..3]),
            'A' => write!(out, "{}", DAYS[weekday]),
            'a' => write!(out, "{}", &DAYS[weekday][..3]),
            'w' => write!(out, "{weekday}"),
            'Z' => write!(out, "UTC"),
            'z' => write!(out, "+0000"),
            'F' => write!(out, "{year}-{month:02}-{day:02}"),
            'T' => write!(out, "{hour:02}:{minute:02}:{second:02}"),
            '%' => write!(out, "%"),
            other => write!(out, "%{other}"),
        };
    }
    out
}

/// (year, month 1-12, day 1-31) of a day count since 1970-01-01 (proleptic Gregorian).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// Inverse of [`civil_from_days`].
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn strftime_formats_utc() {
        // 2025-06-28 13:05:09 UTC, a Saturday.
        let t = UNIX_EPOCH + Duration::from_secs(1_751_115_909);
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t), "2025-06-28 13:05:09");
        assert_eq!(
            strftime("%d %b %Y, %A %B %j %I%p %%x %q", t),
            "28 Jun 2025, Saturday June 179 01PM %x %q"
        );
        assert_eq!(strftime("%Y-%m-%d", UNIX_EPOCH), "1970-01-01");
        assert_eq!(
            strftime("%Y-%m-%d", UNIX_EPOCH + Duration::from_secs(951_782_400)),
            "2000-02-29"
        );
        for days in [-800_000i64, -1, 0, 59, 365, 11_016, 20_267, 2_000_000] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }

    #[test]
    fn python_json_matches_json_dumps() {
        let v: serde_json::Value =
            serde_json::from_str(r#"{"b": [1, 2.5, -0.0001, 1e16, 123.0, 1.5e-7], "a": "é\"\n\u0001", "c": {}, "d": []}"#)
                .unwrap();
        let plain = JsonStyle {
            indent: None,
            sort_keys: false,
            ensure_ascii: false,
        };
        let mut s = String::new();
        python_json(&v, &plain, 0, &mut s);
        assert_eq!(
            s,
            r#"{"b": [1, 2.5, -0.0001, 1e+16, 123.0, 1.5e-07], "a": "é\"\n\u0001", "c": {}, "d": []}"#
        );
        let fancy = JsonStyle {
            indent: Some(2),
            sort_keys: true,
            ensure_ascii: true,
        };
        let mut s = String::new();
        python_json(
            &serde_json::json!({"z": [1, {"y": "😀"}], "a": null}),
            &fancy,
            0,
            &mut s,
        );
        assert_eq!(s, "{\n  \"a\": null,\n  \"z\": [\n    1,\n    {\n      \"y\": \"\\ud83d\\ude00\"\n    }\n  ]\n}");
        assert_eq!(python_float(0.1), "0.1");
        assert_eq!(python_float(1234567890123456.0), "1234567890123456.0");
        assert_eq!(python_float(-2.5e-5), "-2.5e-05");
    }
}
