"""``python -m purestep fit --model.class_path mypkg.MyTask ...``: ``purestep.cli()`` with the
task and data-module classes named on the command line (``loops.command_line``)."""

from purestep.loops.command_line import cli

if __name__ == "__main__":
    cli()
