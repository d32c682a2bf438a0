"""taskledger for the programs that use it: the Python client (`taskledger.client`)
and the MCP server for coding agents (`taskledger.mcp`)."""
