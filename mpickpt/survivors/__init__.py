"""Survivor state across a relaunch (what DLRover's flash checkpoint does for LLMs): when a peer
dies, the survivors undo the step the death interrupted, dump their state to node-local shared
memory (and to the checkpoint directory when asked), and the relaunched job restores them from it
while the dead rank is recovered by the configured policy."""
