"""Prefix caching: full KV blocks found again by their content, so that a shared prefix is computed
and stored once.

A block's K and V depend on its tokens and on every token before it. So a full block is keyed by
its own tokens chained with the key of the block before it: two requests that begin with the same
system prompt produce the same keys for its full blocks, and the second takes the first's blocks
instead of computing its own. The chain is made of serial numbers, one per block ever registered,
rather than of hashes: the dict hashes each key, and on a hash match compares it whole, tokens and
predecessor, so a hash collision can never hand out a wrong block.

More in docs/engine-notes.md.
"""


class PrefixCache:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.block_of: dict[tuple, int] = {}  # (serial of the previous block, tokens) -> block
        self.entry_of: dict[int, tuple[tuple, int]] = {}  # block -> (its key, its serial)
        self.next_serial = 0
        self.version = 0  # changes whenever a key is added or dropped: a lookup may differ then

    def _key(self, previous: int, tokens, i: int) -> tuple:
        return previous, tuple(tokens[i * self.block_size:(i + 1) * self.block_size])

    def lookup(self, tokens) -> list[int]:
        """The blocks holding the longest run of tokens' full blocks already cached, from the first."""
        found, previous = [], -1  # -1: the first block has no predecessor
        for i in range(len(tokens) // self.block_size):
            block = self.block_of.get(self._key(previous, tokens, i))
            if block is None:
                break
            found.append(block)
            previous = self.entry_of[block][1]
        return found

    def register(self, blocks: list[int], tokens) -> None:
        """Key every full block of a sequence (blocks[i] holds its tokens' block i) not keyed yet.
        A block whose content is cached already in another block stays unkeyed."""
        previous = -1
        for i, block in enumerate(blocks[:len(tokens) // self.block_size]):
            if block not in self.entry_of:
                key = self._key(previous, tokens, i)
                if key not in self.block_of:
                    self.block_of[key] = block
                    self.entry_of[block] = (key, self.next_serial)
                    self.next_serial += 1
                    self.version += 1
                block = self.block_of[key]
            previous = self.entry_of[block][1]

    def forget(self, block: int) -> None:
        """The block is about to hold new tokens: its old content can no longer be found."""
        entry = self.entry_of.pop(block, None)
        if entry is not None:
            del self.block_of[entry[0]]
            self.version += 1
