//! How a prompt's token vectors become one embedding (`--pooling`): a server setting that
//! [`crate::config`] holds and [`crate::embeddings`] applies.

/// How a prompt's token vectors become one (`--pooling`, llama.cpp's `llama_pooling_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    /// No pooling: every token's vector (the native routes only).
    None,
    /// The mean of the tokens' vectors.
    Mean,
    /// The first token's vector.
    Cls,
    /// The last token's vector.
    Last,
    /// Ranking (`--reranking`): the first token's vector, whose first value is the score.
    Rank,
}

impl Pooling {
    /// Every pooling, in llama.cpp's numbering (`{arch}.pooling_type`: 0 to 4).
    const ALL: [Pooling; 5] = [
        Pooling::None,
        Pooling::Mean,
        Pooling::Cls,
        Pooling::Last,
        Pooling::Rank,
    ];

    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Pooling::None => "none",
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::Last => "last",
            Pooling::Rank => "rank",
        }
    }

    /// The pooling named `name` (`none`, `mean`, `cls`, `last`, `rank`).
    pub fn named(name: &str) -> Option<Pooling> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }

    /// The pooling the model's metadata gives (`{arch}.pooling_type`), if it gives one.
    pub fn of_model(meta: &hmoe_gguf::Metadata) -> Option<Pooling> {
        let key = format!("{}.pooling_type", meta.architecture()?);
        Self::ALL.get(meta.get_u32(&key)? as usize).copied()
    }

    /// One vector of a prompt's `rows` (`n_embd` floats per token, at least one token);
    /// `None` for [`Pooling::None`].
    pub(crate) fn pool(self, rows: &[f32], n_embd: usize) -> Option<Vec<f32>> {
        let n = rows.len() / n_embd;
        match self {
            Pooling::None => None,
            Pooling::Cls | Pooling::Rank => Some(rows[..n_embd].to_vec()),
            Pooling::Last => Some(rows[(n - 1) * n_embd..].to_vec()),
            Pooling::Mean => {
                // llama.cpp multiplies by a matrix of 1/n: each token's value times 1/n, summed
                // in token order.
                let w = 1.0 / n as f32;
                let mut out = vec![0f32; n_embd];
                for row in rows.chunks_exact(n_embd) {
                    out.iter_mut().zip(row).for_each(|(o, &x)| *o += x * w);
                }
                Some(out)
            }
        }
    }
}
