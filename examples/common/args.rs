//! The recipes' command lines: `--flag value` pairs, taken one flag at a time.
//!
//! ```ignore
//! let mut flags = Flags::from_env();
//! while let Some(flag) = flags.next_flag() {
//!     match flag.as_str() {
//!         "--dir" => dir = flags.value(&flag)?.into(),
//!         "--port" => port = flags.parse(&flag)?,
//!         other => return Err(format!("unknown option {other}").into()),
//!     }
//! }
//! ```

use std::fmt::Display;
use std::str::FromStr;

/// The process's arguments after the program's name.
pub struct Flags(std::iter::Skip<std::env::Args>);

impl Flags {
    pub fn from_env() -> Flags {
        Flags(std::env::args().skip(1))
    }

    /// The next flag, `None` after the last.
    pub fn next_flag(&mut self) -> Option<String> {
        self.0.next()
    }

    /// The value of `flag`: the word after it.
    pub fn value(&mut self, flag: &str) -> Result<String, String> {
        self.0.next().ok_or_else(|| format!("{flag} needs a value"))
    }

    /// The value of `flag`, parsed; an error names the flag.
    pub fn parse<T>(&mut self, flag: &str) -> Result<T, String>
    where
        T: FromStr,
        T::Err: Display,
    {
        self.value(flag)?
            .parse()
            .map_err(|error| format!("{flag}: {error}"))
    }
}
