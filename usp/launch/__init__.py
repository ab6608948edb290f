"""Launchers: ``usp-launch`` (:mod:`usp.launch.cli`) and the command lines it prints or runs
(:mod:`usp.launch.commands`); the shell launchers live in the repository's ``launch/`` directory."""
