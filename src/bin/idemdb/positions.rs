//! `positions list`, `set` and `remove`: log consumers' read positions. Listing opens the store
//! read-only; setting and removing need it to themselves, so that no running consumer holds a
//! position in memory that would undo the change.

use std::io::Write;

use idemdb::Position;
use idemdb::admin::PositionEntry;
use idemdb::format::printable;

use crate::args::{PositionArgs, PositionsCommand};
use crate::json::{position_change_json, positions_json, write_json};
use crate::read::open_read;
use crate::render::{write_position_change, write_positions};
use crate::repair::open_write;
use crate::{EXIT_OK, Failure};

pub fn run(command: PositionsCommand, json: bool, out: &mut impl Write) -> Result<u8, Failure> {
    match command {
        PositionsCommand::List(args) => {
            let store = open_read(&args.store.store)?;
            let consumer = args.consumer.as_ref().map(|consumer| consumer.0.as_slice());
            let entries: Vec<PositionEntry> = store.positions(consumer)?;
            if json {
                write_json(out, &positions_json(&entries))?;
            } else {
                write_positions(out, &entries, store.now_ms())?;
            }
            Ok(EXIT_OK)
        }
        PositionsCommand::Set(args) => change(&args.position, Some(args.offset), json, out),
        PositionsCommand::Remove(args) => change(&args, None, json, out),
    }
}

/// `set` (with an offset) and `remove` (without).
fn change(
    args: &PositionArgs,
    offset: Option<u64>,
    json: bool,
    out: &mut impl Write,
) -> Result<u8, Failure> {
    let store = open_write(&args.store.store, None, &args.wait)?;
    let consumer = &args.consumer.0;
    let previous: Option<Position> = match offset {
        Some(offset) => store.set_position(consumer, &args.source, args.partition, offset)?,
        None => store.remove_position(consumer, &args.source, args.partition)?,
    };
    let label = format!(
        "{} {} partition {}",
        printable(consumer),
        args.source,
        args.partition
    );
    if json {
        write_json(
            out,
            &position_change_json(consumer, args, previous.as_ref(), offset),
        )?;
    } else {
        write_position_change(out, &label, previous.as_ref(), offset)?;
    }
    Ok(EXIT_OK)
}
