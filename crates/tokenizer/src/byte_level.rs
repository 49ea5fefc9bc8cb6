//! GPT-2 style byte-level encoding: every byte is shown as one printable Unicode character so that
//! byte-level BPE vocabularies can store arbitrary bytes as text.
//!
//! Bytes `!`..=`~`, `¡`..=`¬` and `®`..=`ÿ` stand for themselves; the remaining 68 bytes are
//! numbered in increasing order and shown as U+0100 + n.

/// The character that stands for each byte.
pub(crate) fn byte_to_char() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 0u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let b = b as u32;
        let printable =
            (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let cp = if printable {
            b
        } else {
            let cp = 0x100 + next;
            next += 1;
            cp
        };
        *slot = char::from_u32(cp).unwrap_or('\u{FFFD}');
    }
    table
}

/// Decodes the text of a byte-level token into the bytes it stands for. Characters that are not
/// byte characters (seen only in hand-added tokens) are kept as their UTF-8.
pub(crate) fn decode_token_text(text: &str, rev: &ReverseTable) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match rev.get(c) {
            Some(b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out
}

/// Fast character → byte lookup for the byte-level alphabet.
pub(crate) struct ReverseTable {
    low: [i16; 0x144],
}

impl ReverseTable {
    /// Builds the table.
    pub(crate) fn new() -> ReverseTable {
        let mut low = [-1i16; 0x144];
        for (b, c) in byte_to_char().iter().enumerate() {
            low[*c as usize] = b as i16;
        }
        ReverseTable { low }
    }

    /// The byte `c` stands for.
    pub(crate) fn get(&self, c: char) -> Option<u8> {
        let i = c as usize;
        if i < self.low.len() && self.low[i] >= 0 {
            Some(self.low[i] as u8)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode_bytes(bytes: &[u8], table: &[char; 256]) -> String {
        bytes.iter().map(|&b| table[b as usize]).collect()
    }

    #[test]
    fn round_trip_all_bytes() {
        let t = byte_to_char();
        let rev = ReverseTable::new();
        for b in 0..=255u8 {
            assert_eq!(rev.get(t[b as usize]), Some(b));
        }
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(decode_token_text(&encode_bytes(&all, &t), &rev), all);
    }
}
