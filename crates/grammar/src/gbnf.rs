//! GBNF (llama.cpp's grammar format) translated to llguidance's Lark dialect.
//!
//! GBNF: rules `name ::= alternatives`, one per line (a rule goes on over line breaks only
//! inside parentheses or after `|`); elements are `"literals"` with `\n \t \r \\ \" \xHH
//! \uHHHH \UHHHHHHHH` escapes, character classes `[a-z]` / `[^"\\]`, `.` (any character), rule
//! names (`[a-zA-Z0-9-]+`), `( … )` groups, token references `<[123]>` / `<|name|>`, and the
//! repetitions `*`, `+`, `?`, `{m}`, `{m,}`, `{m,n}`, `{,n}`; `#` starts a comment. The start
//! rule is `root`.
//!
//! In the Lark text every GBNF rule `x` becomes `g-x` (upper-case letters as `_` + the
//! lower-case letter, so names stay distinct and are never Lark terminals), literals become
//! JSON strings and character classes `/[…]/` regexes with `\x{…}` escapes.

use std::collections::BTreeMap;
use std::fmt::Write;

use crate::limits::{MAX_ALTERNATIVES, MAX_NESTING, MAX_RULES, MAX_TERMINALS};

/// A GBNF syntax error, with the line and column (1-based) where it was found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("GBNF parse error at line {line}, column {column}: {message}")]
pub struct GbnfError {
    /// Line of the error.
    pub line: usize,
    /// Column of the error (in characters).
    pub column: usize,
    /// What was wrong.
    pub message: String,
}

/// Translates a GBNF grammar to an llguidance Lark grammar whose start rule is GBNF's `root`.
/// A grammar with more than [`MAX_RULES`] rules, [`MAX_TERMINALS`] terminals or
/// [`MAX_ALTERNATIVES`] alternatives, or groups nested deeper than [`MAX_NESTING`], is an error (the translation recurses only into
/// groups).
pub fn gbnf_to_lark(src: &str) -> Result<String, GbnfError> {
    let mut p = Parser {
        chars: src.chars().collect(),
        pos: 0,
        depth: 0,
        terminals: 0,
        alternatives: 0,
    };
    let mut definitions = 0;
    let mut rules: BTreeMap<String, String> = BTreeMap::new();
    let mut used: Vec<(String, usize)> = Vec::new();
    p.space(true);
    while !p.at_end() {
        let name = p.name().ok_or_else(|| p.error("expecting a rule name"))?;
        definitions += 1;
        if definitions > MAX_RULES {
            return Err(p.error(&format!("more than {MAX_RULES} rules (the limit)")));
        }
        p.space(false);
        if !p.eat_str("::=") {
            return Err(p.error("expecting ::="));
        }
        p.space(true);
        let body = p.alternates(false, &mut used)?;
        if !p.at_end() && !p.eat_newline() {
            return Err(p.error("expecting newline or end"));
        }
        p.space(true);
        rules.insert(name, body);
    }
    if !rules.contains_key("root") {
        return Err(GbnfError {
            line: 1,
            column: 1,
            message: "the grammar does not define the rule 'root'".into(),
        });
    }
    if let Some((name, at)) = used.iter().find(|(n, _)| !rules.contains_key(n)) {
        let mut e = p.error_at(*at, "");
        e.message = format!("undefined rule '{name}'");
        return Err(e);
    }
    let mut out = format!("start: {}\n", lark_name("root"));
    for (name, body) in &rules {
        let _ = writeln!(out, "{}: {body}", lark_name(name));
    }
    Ok(out)
}

/// The Lark name of GBNF rule `name`.
fn lark_name(name: &str) -> String {
    let mut s = String::from("g-");
    for c in name.chars() {
        if c.is_ascii_uppercase() {
            s.push('_');
            s.push(c.to_ascii_lowercase());
        } else {
            s.push(c);
        }
    }
    s
}

struct Parser {
    chars: Vec<char>,
    pos: usize,
    /// Groups open at `pos`.
    depth: usize,
    /// Terminals (literals, classes, `.`, token references) read so far.
    terminals: usize,
    /// `|` read so far.
    alternatives: usize,
}

impl Parser {
    fn at_end(&self) -> bool {
        self.pos >= self.chars.len()
    }

    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    fn error(&self, message: &str) -> GbnfError {
        self.error_at(self.pos, message)
    }

    fn error_at(&self, at: usize, message: &str) -> GbnfError {
        let before = &self.chars[..at.min(self.chars.len())];
        let line = before.iter().filter(|&&c| c == '\n').count() + 1;
        let column = before.iter().rev().take_while(|&&c| c != '\n').count() + 1;
        GbnfError {
            line,
            column,
            message: message.to_string(),
        }
    }

    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(c) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn eat_str(&mut self, s: &str) -> bool {
        let n = s.chars().count();
        if self.chars.len() >= self.pos + n
            && self.chars[self.pos..self.pos + n]
                .iter()
                .copied()
                .eq(s.chars())
        {
            self.pos += n;
            true
        } else {
            false
        }
    }

    fn eat_newline(&mut self) -> bool {
        let start = self.pos;
        while matches!(self.peek(), Some('\r' | '\n')) {
            self.pos += 1;
        }
        self.pos > start
    }

    /// Skips blanks and comments, and line breaks when `newlines`.
    fn space(&mut self, newlines: bool) {
        while let Some(c) = self.peek() {
            match c {
                ' ' | '\t' => self.pos += 1,
                '\r' | '\n' if newlines => self.pos += 1,
                '#' => {
                    while self.peek().is_some_and(|c| c != '\n') {
                        self.pos += 1;
                    }
                }
                _ => break,
            }
        }
    }

    fn name(&mut self) -> Option<String> {
        let start = self.pos;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '-')
        {
            self.pos += 1;
        }
        (self.pos > start).then(|| self.chars[start..self.pos].iter().collect())
    }

    fn alternates(
        &mut self,
        nested: bool,
        used: &mut Vec<(String, usize)>,
    ) -> Result<String, GbnfError> {
        let mut alts = vec![self.sequence(nested, used)?];
        while self.eat('|') {
            self.alternatives += 1;
            if self.alternatives > MAX_ALTERNATIVES {
                return Err(self.error(&format!(
                    "more than {MAX_ALTERNATIVES} alternatives (the limit)"
                )));
            }
            self.space(true);
            alts.push(self.sequence(nested, used)?);
        }
        Ok(alts.join(" | "))
    }

    fn sequence(
        &mut self,
        nested: bool,
        used: &mut Vec<(String, usize)>,
    ) -> Result<String, GbnfError> {
        let mut items: Vec<String> = Vec::new();
        // Repetitions applied to the last item, each a group around it in the Lark text.
        let mut wraps = 0;
        loop {
            let at = self.pos;
            let Some(c) = self.peek() else { break };
            if matches!(c, '"' | '[' | '.' | '<') {
                self.terminals += 1;
                if self.terminals > MAX_TERMINALS {
                    return Err(self.error(&format!(
                        "more than {MAX_TERMINALS} terminals (literals, character classes, '.', token references; the limit)"
                    )));
                }
            }
            let item = match c {
                '"' => self.literal()?,
                '[' => self.char_class()?,
                '.' => {
                    self.pos += 1;
                    "/(?s:.)/".to_string()
                }
                '(' => {
                    if self.depth >= MAX_NESTING {
                        return Err(self.error(&format!(
                            "groups nested deeper than {MAX_NESTING} levels (the limit)"
                        )));
                    }
                    self.pos += 1;
                    self.space(true);
                    self.depth += 1;
                    let inner = self.alternates(true, used)?;
                    self.depth -= 1;
                    self.space(true);
                    if !self.eat(')') {
                        return Err(self.error("expecting ')'"));
                    }
                    format!("({inner})")
                }
                '<' => {
                    let start = self.pos;
                    while self.peek().is_some_and(|c| c != '>' && !c.is_whitespace()) {
                        self.pos += 1;
                    }
                    if !self.eat('>') || self.pos - start < 3 {
                        return Err(
                            self.error_at(start, "expecting a token reference <[id]> or <name>")
                        );
                    }
                    self.chars[start..self.pos].iter().collect()
                }
                '*' | '+' | '?' => {
                    let Some(last) = items.pop() else {
                        return Err(self.error(&format!("'{c}' with nothing before it")));
                    };
                    wraps = self.wrap(wraps)?;
                    self.pos += 1;
                    format!("({last}){c}")
                }
                '{' => {
                    let Some(last) = items.pop() else {
                        return Err(self.error("'{' with nothing before it"));
                    };
                    wraps = self.wrap(wraps)?;
                    let range = self.repeat_range()?;
                    format!("({last}){{{range}}}")
                }
                c if c.is_ascii_alphanumeric() || c == '-' => {
                    let name = self.name().unwrap_or_default();
                    used.push((name.clone(), at));
                    lark_name(&name)
                }
                '|' | ')' => break,
                '\r' | '\n' if !nested => break,
                _ => return Err(self.error(&format!("unexpected '{}'", c.escape_debug()))),
            };
            if !matches!(c, '*' | '+' | '?' | '{') {
                wraps = 0;
            }
            items.push(item);
            self.space(nested);
        }
        Ok(match items.is_empty() {
            true => "\"\"".to_string(),
            false => items.join(" "),
        })
    }

    /// A literal `"..."` (at its `"`) as a JSON string.
    fn literal(&mut self) -> Result<String, GbnfError> {
        self.pos += 1;
        let mut text = String::new();
        loop {
            match self.peek() {
                None => return Err(self.error("unexpected end of input in a literal")),
                Some('"') => {
                    self.pos += 1;
                    break;
                }
                Some(_) => text.push(self.char_in_literal()?),
            }
        }
        Ok(json_string(&text))
    }

    /// A character class `[...]` (at its `[`) as a Lark regex.
    fn char_class(&mut self) -> Result<String, GbnfError> {
        self.pos += 1;
        let mut class = String::from("[");
        if self.eat('^') {
            class.push('^');
        }
        let mut empty = true;
        loop {
            match self.peek() {
                None => return Err(self.error("unexpected end of input in a character class")),
                Some(']') if !empty => {
                    self.pos += 1;
                    break;
                }
                Some(_) => {
                    let lo = self.char_in_literal()?;
                    let _ = write!(class, "\\x{{{:x}}}", lo as u32);
                    if self.peek() == Some('-')
                        && self.chars.get(self.pos + 1).is_some_and(|&c| c != ']')
                    {
                        self.pos += 1;
                        let hi = self.char_in_literal()?;
                        if hi < lo {
                            return Err(self.error("character range out of order"));
                        }
                        let _ = write!(class, "-\\x{{{:x}}}", hi as u32);
                    }
                    empty = false;
                }
            }
        }
        class.push(']');
        Ok(format!("/{class}/"))
    }

    /// A repetition range `{m}`, `{m,}` or `{m,n}` (at its `{`), as Lark writes it.
    fn repeat_range(&mut self) -> Result<String, GbnfError> {
        self.pos += 1;
        self.space(false);
        let lo = self.number();
        self.space(false);
        let range = if self.eat(',') {
            self.space(false);
            let hi = self.number();
            self.space(false);
            match hi {
                Some(hi) if hi < lo.unwrap_or(0) => {
                    return Err(self.error("repetition range out of order"))
                }
                Some(hi) => format!("{},{hi}", lo.unwrap_or(0)),
                None => format!("{},", lo.unwrap_or(0)),
            }
        } else {
            match lo {
                Some(n) => n.to_string(),
                None => return Err(self.error("expecting a number")),
            }
        };
        if !self.eat('}') {
            return Err(self.error("expecting '}'"));
        }
        Ok(range)
    }

    /// One more repetition around an item already under `wraps`, within [`MAX_NESTING`].
    fn wrap(&self, wraps: usize) -> Result<usize, GbnfError> {
        match self.depth + wraps + 1 > MAX_NESTING {
            true => Err(self.error(&format!(
                "groups and repetitions nested deeper than {MAX_NESTING} levels (the limit)"
            ))),
            false => Ok(wraps + 1),
        }
    }

    fn number(&mut self) -> Option<u64> {
        let start = self.pos;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.pos += 1;
        }
        let s: String = self.chars[start..self.pos].iter().collect();
        s.parse().ok()
    }

    /// One character of a literal or class, escapes decoded.
    fn char_in_literal(&mut self) -> Result<char, GbnfError> {
        let Some(c) = self.peek() else {
            return Err(self.error("unexpected end of input"));
        };
        self.pos += 1;
        if c != '\\' {
            return Ok(c);
        }
        let Some(e) = self.peek() else {
            return Err(self.error("unexpected end of input after '\\'"));
        };
        self.pos += 1;
        let hex = |p: &mut Parser, n: usize| -> Result<char, GbnfError> {
            let start = p.pos;
            let digits: String = p.chars.iter().skip(p.pos).take(n).collect();
            if digits.len() != n || !digits.chars().all(|c| c.is_ascii_hexdigit()) {
                return Err(p.error_at(start, &format!("expecting {n} hex digits")));
            }
            p.pos += n;
            u32::from_str_radix(&digits, 16)
                .ok()
                .and_then(char::from_u32)
                .ok_or_else(|| p.error_at(start, "invalid character code"))
        };
        Ok(match e {
            'n' => '\n',
            't' => '\t',
            'r' => '\r',
            '\\' | '"' | '[' | ']' | '-' | '^' => e,
            'x' => hex(self, 2)?,
            'u' => hex(self, 4)?,
            'U' => hex(self, 8)?,
            other => {
                return Err(self.error(&format!("unknown escape '\\{}'", other.escape_debug())))
            }
        })
    }
}

/// `text` as a Lark (JSON) string literal.
fn json_string(text: &str) -> String {
    serde_json::Value::String(text.to_string())
        .to_string()
        .replace('\u{7f}', "\\u007f")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn translates_rules_literals_classes_and_repetitions() {
        let lark = gbnf_to_lark(
            "root ::= greeting (\" \" Name)? [0-9]{2,3} # comment\n\
             greeting ::= \"hi\\n\" | \"yo\" |\n\
               \"hey\"\n\
             Name ::= [^\"\\\\]+ .*\n",
        )
        .unwrap();
        assert!(lark.starts_with("start: g-root\n"), "{lark}");
        assert!(
            lark.contains("g-root: g-greeting ((\" \" g-_name))? (/[\\x{30}-\\x{39}]/){2,3}"),
            "{lark}"
        );
        assert!(
            lark.contains("g-greeting: \"hi\\n\" | \"yo\" | \"hey\""),
            "{lark}"
        );
        assert!(
            lark.contains("g-_name: (/[^\\x{22}\\x{5c}]/)+ (/(?s:.)/)*"),
            "{lark}"
        );
    }

    #[test]
    fn errors_say_where_and_what() {
        let e = gbnf_to_lark("root ::= (").unwrap_err();
        assert_eq!((e.line, e.column), (1, 11), "{e}");
        assert!(e.to_string().contains("expecting ')'"), "{e}");
        let e = gbnf_to_lark("root ::= foo").unwrap_err();
        assert!(e.to_string().contains("undefined rule 'foo'"), "{e}");
        let e = gbnf_to_lark("expr ::= \"a\"").unwrap_err();
        assert!(e.to_string().contains("'root'"), "{e}");
        let e = gbnf_to_lark("root ::= \"a\n").unwrap_err();
        assert!(
            e.to_string().contains("expecting newline") || e.to_string().contains("literal"),
            "{e}"
        );
        assert!(gbnf_to_lark("root ::= [z-a]").is_err());
        assert!(gbnf_to_lark("root ::= \"\\q\"").is_err());
        assert!(gbnf_to_lark("root ::= *").is_err());
        assert!(gbnf_to_lark("root = \"a\"").is_err());
    }
}
