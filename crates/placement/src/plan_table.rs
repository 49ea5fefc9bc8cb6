//! The plan as the text table that `--fit`, `serve` and `bench` print.

use crate::plan::Plan;

fn mib(b: u64) -> String {
    format!("{}", (b as f64 / (1024.0 * 1024.0)).round() as u64)
}

impl Plan {
    /// The plan as a text table, one row per device, sizes in MiB: layers (attention + KV),
    /// expert layers, weights, KV, compute, overhead, total, free, free after loading, margin.
    pub fn table(&self) -> String {
        self.table_named(&[])
    }

    /// [`Plan::table`] with GPU `i` called `names[i]` where given (a device the caller
    /// selected by another name, such as the reference device `REF0`), else `CUDA<i>`.
    pub fn table_named(&self, names: &[String]) -> String {
        let header = [
            "device", "layers", "experts", "weights", "kv", "compute", "overhead", "total", "free",
            "left", "margin",
        ];
        let mut rows = vec![header.map(String::from).to_vec()];
        for d in &self.devices {
            let opt = |v: Option<u64>| v.map_or("-".to_string(), mib);
            let left = d.headroom().map_or("-".to_string(), |h| {
                let m = (h as f64 / (1024.0 * 1024.0)).round() as i64;
                m.to_string()
            });
            rows.push(vec![
                d.device.name_in(names),
                d.layers.to_string(),
                d.expert_layers.to_string(),
                mib(d.weights),
                mib(d.kv),
                mib(d.compute),
                mib(d.overhead),
                mib(d.total()),
                opt(d.free),
                left,
                if d.device.is_gpu() {
                    mib(d.margin)
                } else {
                    "-".to_string()
                },
            ]);
        }
        let widths: Vec<usize> = (0..header.len())
            .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
            .collect();
        let mut out = String::new();
        for r in &rows {
            let cells: Vec<String> = r
                .iter()
                .enumerate()
                .map(|(c, s)| {
                    if c == 0 {
                        format!("{s:<w$}", w = widths[c])
                    } else {
                        format!("{s:>w$}", w = widths[c])
                    }
                })
                .collect();
            out.push_str(cells.join("  ").trim_end());
            out.push('\n');
        }
        out.push_str(&format!(
            "sizes in MiB; ctx {} (KV cells: {} full{}), ubatch {}, -ngl {} of {}\n",
            self.n_ctx,
            self.kv_cells_full,
            if self.kv_cells_swa > 0 {
                format!(", {} sliding", self.kv_cells_swa)
            } else {
                String::new()
            },
            self.n_ubatch,
            self.n_gpu_layers,
            self.n_layer + 1
        ));
        out
    }
}
