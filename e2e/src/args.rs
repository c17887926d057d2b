//! The checkers' command lines: `--name value` options and bare `--flag`s, in any order; an
//! option given twice takes its last value (a script's defaults come first, the caller's
//! arguments after them). A checker asks for each option it knows, with its default; whatever
//! is left is refused, so a misspelt option fails the run instead of being ignored.

use std::path::PathBuf;
use std::str::FromStr;

use crate::BoxError;
use crate::plan::{Plan, Rng, plan};

/// The arguments not yet taken.
pub struct Args {
    left: Vec<String>,
}

impl Args {
    /// The process's arguments (after the program name).
    pub fn from_env() -> Args {
        Args::from(std::env::args().skip(1))
    }

    pub fn from(args: impl IntoIterator<Item = String>) -> Args {
        Args {
            left: args.into_iter().collect(),
        }
    }

    /// The value after the last `--name`, parsed; `default` when the option is absent. Every
    /// `--name` and its value are taken.
    pub fn value<T>(&mut self, name: &str, default: T) -> Result<T, BoxError>
    where
        T: FromStr,
        T::Err: std::fmt::Display,
    {
        let flag = format!("--{name}");
        let mut last = None;
        while let Some(at) = self.left.iter().position(|arg| *arg == flag) {
            if at + 1 >= self.left.len() {
                return Err(format!("{flag} needs a value").into());
            }
            last = Some(self.left.remove(at + 1));
            self.left.remove(at);
        }
        let Some(text) = last else {
            return Ok(default);
        };
        text.parse()
            .map_err(|error| format!("{flag} {text}: {error}").into())
    }

    /// Whether the bare `--name` was given (once or more; all are taken).
    pub fn flag(&mut self, name: &str) -> bool {
        let flag = format!("--{name}");
        let before = self.left.len();
        self.left.retain(|arg| *arg != flag);
        self.left.len() < before
    }

    /// Refuses whatever no option took.
    pub fn finish(self) -> Result<(), BoxError> {
        match self.left.first() {
            None => Ok(()),
            Some(unknown) => Err(format!("unknown option {unknown}").into()),
        }
    }
}

/// What every checker's run is made of: `--orders N` distinct orders, `--resend-percent P` of
/// them resent, the first `--reused N` ids reused with other content, published at `--rate`
/// messages per second, at least `--min-kills N` random SIGKILLs, in `--work DIR`, from
/// `--seed N`.
pub struct Workload {
    pub orders: usize,
    pub resend_percent: u64,
    pub reused: usize,
    pub rate: u64,
    pub min_kills: u64,
    pub work: PathBuf,
    pub seed: u64,
}

impl Workload {
    /// The workload's options, with the defaults every checker shares but the rate; the work
    /// folder defaults to `idemdb-<checker>` in the system's temporary directory.
    pub fn parse(args: &mut Args, checker: &str, rate: u64) -> Result<Workload, BoxError> {
        let workload = Workload {
            orders: args.value("orders", 2000)?,
            resend_percent: args.value("resend-percent", 20)?,
            reused: args.value("reused", 20)?,
            rate: args.value("rate", rate)?,
            min_kills: args.value("min-kills", 10)?,
            work: args.value(
                "work",
                std::env::temp_dir().join(format!("idemdb-{checker}")),
            )?,
            seed: args.value("seed", 1)?,
        };
        check(
            workload.orders > 0 && workload.rate > 0,
            "--orders and --rate must be at least 1",
        )?;
        check(
            workload.reused <= workload.orders,
            "--reused cannot exceed --orders",
        )?;
        check(
            workload.resend_percent <= 100,
            "--resend-percent is 0..=100",
        )?;
        Ok(workload)
    }

    /// The run's plan, and the generator that drew it (the run's other draws go on from it).
    pub fn plan(&self) -> (Plan, Rng) {
        let mut rng = Rng(self.seed);
        let plan = plan(self.orders, self.resend_percent, self.reused, &mut rng);
        (plan, rng)
    }
}

/// `Err(message)` unless `holds`: an option outside its range.
pub fn check(holds: bool, message: &str) -> Result<(), BoxError> {
    if holds { Ok(()) } else { Err(message.into()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(text: &str) -> Args {
        Args::from(text.split_whitespace().map(str::to_owned))
    }

    #[test]
    fn options_are_taken_in_any_order_and_defaults_fill_the_rest() {
        let mut given = args("--seed 7 --negative-control --orders 10");
        assert_eq!(given.value("orders", 1usize).unwrap(), 10);
        assert!(given.flag("negative-control"));
        assert_eq!(given.value("rate", 400u64).unwrap(), 400);
        assert_eq!(given.value("seed", 1u64).unwrap(), 7);
        given.finish().unwrap();
    }

    #[test]
    fn an_option_given_twice_takes_its_last_value() {
        let mut given =
            args("--orders 3000 --negative-control --rate 400 --orders 100000 --negative-control");
        assert_eq!(given.value("orders", 1usize).unwrap(), 100_000);
        assert!(given.flag("negative-control"));
        assert_eq!(given.value("rate", 1u64).unwrap(), 400);
        given.finish().unwrap();
    }

    #[test]
    fn a_missing_value_a_bad_value_and_an_unknown_option_are_refused() {
        assert!(args("--orders").value("orders", 1usize).is_err());
        assert!(args("--orders many").value("orders", 1usize).is_err());
        let mut given = args("--oders 10");
        assert_eq!(given.value("orders", 1usize).unwrap(), 1);
        assert!(given.finish().is_err());
    }
}
