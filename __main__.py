"""``python -m purestep fit --model.class_path mypkg.MyTask ...``: ``purestep.cli()`` with the
task and data-module classes named on the command line (``loops.cli``)."""

from purestep.loops.cli import cli

if __name__ == "__main__":
    cli()
