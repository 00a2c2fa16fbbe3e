//! The generation loop: prefill the new prompt tokens, then sample and decode one token at a time,
//! streaming text as it becomes complete, until an end-of-sequence id, a stop string, the token
//! budget or the context limit.

use crate::chat::Tokenizer;
use crate::engine::Engine;
use crate::error::Result;
use crate::guided::{generate_guided, Hooks, Step};
use crate::sampling::SamplingParams;
use std::time::Duration;

#[derive(Debug, Clone, Default)]
pub struct GenerationConfig {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation ends when the text contains one of these; the stop string is not emitted.
    pub stop_strings: Vec<String>,
    /// Generation ends when one of these ids is sampled; it is not emitted nor cached.
    pub eos_ids: Vec<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence id was sampled.
    Eos,
    /// A stop string appeared.
    Stop,
    /// `max_tokens` were generated.
    Length,
    /// The sequence reached the state's token limit.
    ContextFull,
    /// The caller's cancellation check said stop (see [`generate_cancellable`]).
    Cancelled,
}

#[derive(Debug, Clone)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    /// Tokens sampled (the EOS that ended the run excluded).
    pub generated_tokens: usize,
    pub prefill_time: Duration,
    /// Forward passes of the decode loop (one per generated token after the first).
    pub decode_steps: usize,
    pub decode_time: Duration,
    /// From the start of the prefill to the first sampled token.
    pub time_to_first_token: Duration,
    pub finish: FinishReason,
}

impl GenerationStats {
    pub fn prefill_tok_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_time.as_secs_f64().max(1e-9)
    }

    pub fn decode_tok_per_s(&self) -> f64 {
        self.decode_steps as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// Runs `prompt` (tokens not yet in the engine's cache) and generates. `history` holds the ids already in the
/// cache (for the penalties' window) and is extended with the prompt and every generated id
/// that enters the cache. `on_text` receives text pieces as they become complete.
pub fn generate(
    engine: &mut dyn Engine,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    history: &mut Vec<u32>,
    cfg: &GenerationConfig,
    on_text: &mut dyn FnMut(&str),
) -> Result<GenerationStats> {
    let never = || false;
    generate_cancellable(engine, tokenizer, prompt, history, cfg, on_text, &never)
}

/// [`generate`] that also ends, with [`FinishReason::Cancelled`], as soon as `cancelled()`
/// returns true. It is asked before the prefill, between the prefill's pieces
/// ([`Engine::prefill_piece`]) and before every decode step, so a server can drop the work of a
/// client that went away within one token or one prefill piece. A cancelled run emits nothing more
/// (held-back text is dropped) and leaves the engine's cache and `history` consistent with each other.
#[allow(clippy::too_many_arguments)]
pub fn generate_cancellable(
    engine: &mut dyn Engine,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    history: &mut Vec<u32>,
    cfg: &GenerationConfig,
    on_text: &mut dyn FnMut(&str),
    cancelled: &dyn Fn() -> bool,
) -> Result<GenerationStats> {
    let mut on_step = |step: Step| {
        if let Step::Text(t) = step {
            on_text(t)
        }
    };
    generate_guided(
        engine,
        tokenizer,
        prompt,
        history,
        cfg,
        &mut Hooks::default(),
        &mut on_step,
        cancelled,
    )
}

/// Holds back text that could be the start of a stop string, so the stream never shows part
/// of one; reports when one appears.
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

impl StopMatcher {
    pub fn new(stops: &[String]) -> StopMatcher {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
        }
    }

    /// Adds text; returns (text safe to show, whether a stop string was found). After a hit the
    /// returned text ends right before the stop string.
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.pending.push_str(text);
        if self.stops.is_empty() {
            return (std::mem::take(&mut self.pending), false);
        }
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        // Longest suffix of pending that is a proper prefix of some stop string.
        let hold = self
            .pending
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| self.stops.iter().any(|s| s.starts_with(&self.pending[i..])))
            .unwrap_or(self.pending.len());
        let out = self.pending[..hold].to_string();
        self.pending.drain(..hold);
        (out, false)
    }

    /// What is still held back (the stream ended without completing a stop string).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut shown = String::new();
        for p in pieces {
            let (out, hit) = m.push(p);
            // Nothing shown may end with a partial stop string unless the stream continues past it.
            shown.push_str(&out);
            if hit {
                return (shown, true);
            }
        }
        shown.push_str(&m.flush());
        (shown, false)
    }

    #[test]
    fn stop_string_split_across_pieces_is_never_shown() {
        assert_eq!(
            run(&["</s>"], &["Hello <", "/", "s> more"]),
            ("Hello ".into(), true)
        );
    }

    #[test]
    fn false_start_is_released() {
        let stops = vec!["STOP".to_string()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("ab ST"), ("ab ".into(), false));
        assert_eq!(m.push("ART"), ("START".into(), false));
    }

    #[test]
    fn earliest_of_several_stops_and_multibyte() {
        assert_eq!(run(&["ü!", "x"], &["aé", "ü", "!x"]), ("aé".into(), true));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&["zz"], &["a", "z"]), ("az".into(), false));
    }
}
