//! The engine's log settings, shared by the command line and the Python module: which
//! records (a level, or a filter of targets and levels), from where (an option, else
//! `FREIGHT_LOG`, else `RUST_LOG`), and how they are written (text, or one JSON object
//! per line for a log collector).

use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::EnvFilter;

/// The variables a filter is read from, in order: the project's own name for it, then
/// the Rust ecosystem's.
pub const FILTER_VARS: [&str; 2] = ["FREIGHT_LOG", "RUST_LOG"];
/// The variable naming the format (`text` or `json`) where no option does.
pub const FORMAT_VAR: &str = "FREIGHT_LOG_FORMAT";
/// The level names a filter takes (any case).
pub const LEVELS: [&str; 6] = ["error", "warn", "info", "debug", "trace", "off"];

/// How log records are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Format {
    /// One line of text per record (colours only on a terminal).
    #[default]
    Text,
    /// One JSON object per line: time, level, target, message and fields.
    Json,
}

impl Format {
    pub fn parse(value: &str) -> Result<Format, String> {
        match value.trim().to_ascii_lowercase().as_str() {
            "text" => Ok(Format::Text),
            "json" => Ok(Format::Json),
            _ => Err(format!("unknown log format '{value}' (give text or json)")),
        }
    }

    /// The format `FREIGHT_LOG_FORMAT` names, if it is set (and not blank).
    pub fn from_env() -> Result<Option<Format>, String> {
        match std::env::var(FORMAT_VAR) {
            Ok(v) if !v.trim().is_empty() => Format::parse(&v).map(Some).map_err(|e| format!("{FORMAT_VAR}: {e}")),
            _ => Ok(None),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Format::Text => "text",
            Format::Json => "json",
        }
    }
}

/// The filter `spec` describes: comma-separated directives, each a level (`debug`) or a
/// target and its level (`freight_core=debug`). A bare word is a level, or else (as
/// tracing and env_logger read it) a target at every level; one that is a level
/// misspelt (`debg`) is refused, since tracing would take it for a target and quietly
/// log nothing the user asked for.
pub fn filter(spec: &str) -> Result<EnvFilter, String> {
    let usage = || format!("give one of {}, or TARGET=LEVEL such as freight_core=debug", LEVELS.join(", "));
    if spec.trim().is_empty() {
        return Err(format!("empty log level ({})", usage()));
    }
    for directive in spec.split(',').map(str::trim).filter(|d| !d.is_empty() && !d.contains('[')) {
        match directive.rsplit_once('=') {
            Some((_, level)) if level.parse::<LevelFilter>().is_err() => {
                return Err(format!("unknown log level '{level}' in '{directive}' ({})", usage()));
            }
            None if directive.parse::<LevelFilter>().is_err() => {
                if let Some(near) = misspelt_level(directive) {
                    return Err(format!("unknown log level '{directive}' (did you mean '{near}'? {})", usage()));
                }
            }
            _ => {}
        }
    }
    EnvFilter::try_new(spec).map_err(|e| format!("bad log filter '{spec}': {e} ({})", usage()))
}

/// The level `word` is a slip of the keyboard away from, if any (two edits at most, and
/// fewer than the word's own length).
fn misspelt_level(word: &str) -> Option<&'static str> {
    let word = word.to_ascii_lowercase();
    LEVELS
        .iter()
        .map(|&level| (strsim::levenshtein(&word, level), level))
        .filter(|&(d, _)| d <= 2 && d < word.len())
        .min_by_key(|&(d, _)| d)
        .map(|(_, level)| level)
}

/// The filter the environment asks for: `FREIGHT_LOG`, else `RUST_LOG` (the first that
/// is set and not blank), with the variable's name; an error names the variable.
pub fn filter_from_env() -> Result<Option<(EnvFilter, &'static str)>, String> {
    for var in FILTER_VARS {
        if let Ok(spec) = std::env::var(var) {
            if !spec.trim().is_empty() {
                return filter(&spec).map(|f| Some((f, var))).map_err(|e| format!("{var}='{spec}': {e}"));
            }
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_targets_and_filters_pass_and_misspelt_levels_do_not() {
        for good in ["debug", "WARN", "off", "freight_core=debug", "freight_core=debug,info", "hyper", "a::b=trace"] {
            assert!(filter(good).is_ok(), "{good}");
        }
        let err = filter("debg").unwrap_err();
        assert!(err.contains("unknown log level 'debg'") && err.contains("did you mean 'debug'"), "{err}");
        assert!(filter("info,warnn").unwrap_err().contains("did you mean 'warn'"));
        let err = filter("freight_core=verbose").unwrap_err();
        assert!(err.contains("unknown log level 'verbose' in 'freight_core=verbose'"), "{err}");
        assert!(filter(" ").unwrap_err().starts_with("empty log level"));
    }

    #[test]
    fn formats_parse_by_name_in_any_case() {
        assert_eq!(Format::parse("JSON"), Ok(Format::Json));
        assert_eq!(Format::parse(" text "), Ok(Format::Text));
        assert!(Format::parse("yaml").unwrap_err().contains("give text or json"));
    }
}
