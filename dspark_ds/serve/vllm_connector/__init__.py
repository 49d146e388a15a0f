"""vLLM's own Python imports `shared_storage_hidden_states` from this folder (on its PYTHONPATH, as
`kv_connector_module_path`); nothing in dspark-ds imports it. Keep nothing else here: every
module in the folder is importable by name inside the vLLM server."""
