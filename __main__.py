"""``python -m purestep fit --model.class_path mypkg.MyTask ...``: ``purestep.cli()`` with the
task and data-module classes named on the command line (``loops.command_line``).

Start-up: the command line's imports (torch among them) create over a quarter of a million
long-lived objects and next to no garbage, and the cyclic garbage collector would scan them
all several times while they load (about 0.1 s a full pass here). So the collector is
paused for the imports, and what they created is then moved out of its reach
(``gc.freeze()``: it is never scanned again, as for a forking server's preloaded state)
before collection resumes for everything the run creates."""

import gc

gc.disable()
try:
    from purestep.loops.command_line import cli

    gc.freeze()
finally:
    gc.enable()

if __name__ == "__main__":
    cli()
