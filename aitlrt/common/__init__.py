"""The bottom layer: helpers every other part uses (paths, git, child processes, the node's resources, the bundled
model, repository copies). Imports nothing else of ``aitlrt``; ``aitlrt_server`` may import from here."""
