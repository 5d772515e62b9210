from perseus_ext.cli import console

console()
