"""Names the torch exporter gives things in the graphs it writes (read by replication and the ORT rewrites)."""

WRAPPER_PREFIX = "inner."  # torch_to_onnx._ExplicitArgs holds the traced module as `inner`
SCOPES_KEY = "pkg.torch.onnx.name_scopes"  # node metadata: the module path of the code that made the node
CLASSES_KEY = "pkg.torch.onnx.class_hierarchy"  # node metadata: the classes of those modules
BLOCK_ROWS = "block_len"  # axis 1 of a draft prefix graph's block inputs: it drafts as many rows as it is handed
# A DFlash draft's prefix graph input of shape [batch, n]: only n is read, the proposals that go through its head
PROPOSAL_ROWS = "proposal_rows"
