//! Incremental detokenization: token pieces are byte strings, and one UTF-8 character may be
//! split across several tokens (byte-level BPE, SentencePiece byte fallback).

use crate::Tokenizer;

/// Turns a stream of token ids into text, emitting only complete UTF-8 characters.
///
/// Bytes that end in the middle of a character are held back until the next token completes
/// them. Bytes that can never form a valid character are emitted as U+FFFD (one per maximal
/// invalid sequence, like `String::from_utf8_lossy`).
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    /// A decoder with nothing held back.
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// Feeds one token; returns the text completed by it (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> String {
        self.push_bytes(tokenizer.token_bytes(id))
    }

    /// Feeds raw bytes; returns the text completed by them (possibly empty).
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut consumed = 0;
        loop {
            let rest = &self.pending[consumed..];
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    consumed = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The first `valid_up_to` bytes are valid UTF-8 by definition.
                    out.push_str(std::str::from_utf8(&rest[..valid]).unwrap_or_default());
                    match e.error_len() {
                        // Incomplete character at the end: hold it back.
                        None => {
                            consumed += valid;
                            break;
                        }
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            consumed += valid + bad;
                        }
                    }
                }
            }
        }
        self.pending.drain(..consumed);
        out
    }

    /// Whether bytes are held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Ends the stream: returns held-back bytes (an incomplete character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_partial_characters() {
        let mut d = StreamDecoder::new();
        let euro = "€".as_bytes(); // e2 82 ac
        assert_eq!(d.push_bytes(b"a"), "a");
        assert_eq!(d.push_bytes(&euro[..1]), "");
        assert!(d.has_pending());
        assert_eq!(d.push_bytes(&euro[1..2]), "");
        assert_eq!(d.push_bytes(&[euro[2], b'b']), "€b");
        assert!(!d.has_pending());
    }

    #[test]
    fn invalid_bytes_become_replacement() {
        let mut d = StreamDecoder::new();
        assert_eq!(d.push_bytes(&[0xff, b'x']), "\u{FFFD}x");
        assert_eq!(d.push_bytes(&[0xe2, 0x82]), "");
        assert_eq!(d.push_bytes(b"y"), "\u{FFFD}y");
        assert_eq!(d.push_bytes(&[0xf0, 0x9f]), "");
        assert_eq!(d.finish(), "\u{FFFD}");
        assert_eq!(d.finish(), "");
    }
}
