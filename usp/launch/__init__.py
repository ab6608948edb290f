"""Launchers: ``usp-launch`` (:mod:`usp.launch.cli`, one module per mode: :mod:`usp.launch.local`,
:mod:`usp.launch.torchrun`, :mod:`usp.launch.slurm`, sharing :mod:`usp.launch.common`) and the command lines it
prints or runs (:mod:`usp.launch.commands`); the shell launchers live in the repository's ``launch/`` directory."""
